"""Counters of the tier chain: per tier hits, bytes, latency, errors, verify failures; egress.

Plain numbers behind a lock (prefetch threads update them); ``snapshot()`` returns a dict.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TierCounters:
    hits: int = 0
    bytes: int = 0
    misses: int = 0
    errors: int = 0
    verify_failures: int = 0
    fetch_seconds: float = 0.0
    fetch_seconds_max: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.__dict__)
        d["fetch_seconds_mean"] = self.fetch_seconds / self.hits if self.hits else 0.0
        return d


@dataclass
class LoaderStats:
    tiers: dict[str, TierCounters] = field(default_factory=lambda: defaultdict(TierCounters))
    egress: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))  # (source, reader) -> bytes
    writebacks: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hit(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            c = self.tiers[tier]
            c.hits += 1
            c.bytes += nbytes
            c.fetch_seconds += seconds
            c.fetch_seconds_max = max(c.fetch_seconds_max, seconds)

    def count(self, tier: str, what: str) -> None:
        with self._lock:
            c = self.tiers[tier]
            setattr(c, what, getattr(c, what) + 1)

    def add_egress(self, source: str, reader: str, nbytes: int) -> None:
        with self._lock:
            self.egress[(source, reader)] += nbytes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tiers": {name: c.to_dict() for name, c in self.tiers.items()},
                "egress_bytes": {f"{src}->{dst}": n for (src, dst), n in self.egress.items()},
                "writebacks": self.writebacks,
            }


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot from several (DataLoader workers, ranks): counts add up, maxima stay maxima."""
    tiers: dict[str, dict[str, Any]] = {}
    egress: dict[str, int] = defaultdict(int)
    writebacks = 0
    for snap in snapshots:
        for name, c in snap.get("tiers", {}).items():
            t = tiers.setdefault(name, TierCounters().to_dict())
            for k, v in c.items():
                t[k] = max(t[k], v) if k == "fetch_seconds_max" else t[k] + v
        for k, n in snap.get("egress_bytes", {}).items():
            egress[k] += n
        writebacks += snap.get("writebacks", 0)
    for t in tiers.values():
        t["fetch_seconds_mean"] = t["fetch_seconds"] / t["hits"] if t["hits"] else 0.0
    return {"tiers": tiers, "egress_bytes": dict(egress), "writebacks": writebacks}
