"""Counters of the tier chain: per tier hits, bytes, latency, errors, verify failures; egress.

``LoaderStats`` holds plain numbers behind a lock (prefetch threads update them); ``snapshot()``
returns a frozen ``StatsSnapshot``. Snapshots of several processes add up with ``merge``, and
cross files as ``to_dict()`` (the one writer) and ``StatsSnapshot.from_dict`` (the one reader).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from geoshard.errors import DataError

STATS_VERSION = 1
_EGRESS_SEP = "->"  # the wire form's key of an egress pair: "source->reader"


class RegionPair(NamedTuple):
    """Egress: bytes read from ``source``'s bucket by a rank in ``reader``."""

    source: str
    reader: str

    def key(self) -> str:
        return f"{self.source}{_EGRESS_SEP}{self.reader}"


@dataclass(frozen=True)
class TierSnapshot:
    hits: int = 0
    bytes: int = 0
    misses: int = 0
    errors: int = 0
    verify_failures: int = 0
    fetch_seconds: float = 0.0
    fetch_seconds_max: float = 0.0

    @property
    def fetch_seconds_mean(self) -> float:
        return self.fetch_seconds / self.hits if self.hits else 0.0

    def plus(self, other: TierSnapshot) -> TierSnapshot:
        """Counts add up, maxima stay maxima."""
        return TierSnapshot(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "fetch_seconds_max"},
            fetch_seconds_max=max(self.fetch_seconds_max, other.fetch_seconds_max),
        )

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "fetch_seconds_mean": self.fetch_seconds_mean}


@dataclass(frozen=True)
class StatsSnapshot:
    tiers: Mapping[str, TierSnapshot] = field(default_factory=dict)
    egress: Mapping[RegionPair, int] = field(default_factory=dict)
    writebacks: int = 0

    @property
    def egress_total(self) -> int:
        return sum(self.egress.values())

    def to_dict(self) -> dict[str, Any]:
        """The wire form (rank summaries, report.json, ``loader.stats()``)."""
        return {
            "version": STATS_VERSION,
            "tiers": {name: c.to_dict() for name, c in self.tiers.items()},
            "egress_bytes": {pair.key(): n for pair, n in self.egress.items()},
            "writebacks": self.writebacks,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "loader stats") -> StatsSnapshot:
        """The wire form read back (no version: 1); DataError naming ``where`` when it is not one."""
        wrong = f"{where}: loader is not the loader's stats (tiers, egress_bytes, writebacks, dropped_samples)"
        if not isinstance(d, Mapping):
            raise DataError(wrong)
        version = d.get("version", 1)
        if not _is_int(version) or version > STATS_VERSION:
            raise DataError(f"{where}: loader stats of version {version!r}; this geoshard reads up to {STATS_VERSION}: upgrade it")
        tiers, egress = d.get("tiers", {}), d.get("egress_bytes", {})
        if not isinstance(tiers, Mapping) or not isinstance(egress, Mapping) or not _is_int(d.get("writebacks", 0)):
            raise DataError(wrong)
        names = [f.name for f in fields(TierSnapshot)]
        out_tiers = {}
        for name, c in tiers.items():
            if not isinstance(c, Mapping) or not all(_is_number(c.get(k, 0)) for k in names):
                raise DataError(wrong)
            out_tiers[name] = TierSnapshot(**{k: c.get(k, 0) for k in names})
        pairs: dict[RegionPair, int] = {}
        for key, n in egress.items():
            source, sep, reader = str(key).partition(_EGRESS_SEP)
            if not sep or not _is_int(n):
                raise DataError(wrong)
            pairs[RegionPair(source, reader)] = n
        return cls(tiers=out_tiers, egress=pairs, writebacks=d.get("writebacks", 0))


def merge(snapshots: Iterable[StatsSnapshot]) -> StatsSnapshot:
    """One snapshot from several (DataLoader workers, ranks, segments): counts add up, maxima stay maxima."""
    tiers: dict[str, TierSnapshot] = {}
    egress: dict[RegionPair, int] = defaultdict(int)
    writebacks = 0
    for snap in snapshots:
        for name, c in snap.tiers.items():
            tiers[name] = tiers[name].plus(c) if name in tiers else c
        for pair, n in snap.egress.items():
            egress[pair] += n
        writebacks += snap.writebacks
    return StatsSnapshot(tiers=tiers, egress=dict(egress), writebacks=writebacks)


@dataclass
class LoaderStats:
    _tiers: dict[str, TierSnapshot] = field(default_factory=dict)
    _egress: dict[RegionPair, int] = field(default_factory=lambda: defaultdict(int))
    _writebacks: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hit(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            c = self._tiers.get(tier, TierSnapshot())
            self._tiers[tier] = dataclasses.replace(
                c,
                hits=c.hits + 1,
                bytes=c.bytes + nbytes,
                fetch_seconds=c.fetch_seconds + seconds,
                fetch_seconds_max=max(c.fetch_seconds_max, seconds),
            )

    def count(self, tier: str, what: str) -> None:
        with self._lock:
            c = self._tiers.get(tier, TierSnapshot())
            self._tiers[tier] = dataclasses.replace(c, **{what: getattr(c, what) + 1})

    def add_egress(self, source: str, reader: str, nbytes: int) -> None:
        with self._lock:
            self._egress[RegionPair(source, reader)] += nbytes

    def writeback(self) -> None:
        with self._lock:
            self._writebacks += 1

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                tiers=dict(self._tiers),
                egress=dict(self._egress),
                writebacks=self._writebacks,
            )


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
