"""What ``geoshard probe`` measured: a cell per region, a row of the region matrix per host.

Written as ``--json`` and read back with :meth:`ProbeResult.from_dict`, so results from several
hosts can be drawn as one matrix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProbeCell:
    """One region as seen from one host. Times in ms, throughput in MB/s (10**6 bytes/s)."""

    region: str
    url: str  # s3://bucket/prefix
    endpoint: str  # as displayed: no user:password part
    latency_ms_median: float | None = None
    latency_ms_p90: float | None = None
    latency_samples: int = 0
    throughput_mb_s: float | None = None  # ranged GET of throughput_bytes, best sample
    throughput_bytes: int = 0  # bytes per GET the figure is based on
    throughput_key: str | None = None
    upload_mb_s: float | None = None  # only when the probe object was written
    error: str | None = None
    seconds: float = 0.0  # spent probing this region

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ProbeResult:
    """A row of the region matrix: every probed region from ``origin`` (this host)."""

    origin: str
    created: str  # ISO 8601, UTC
    cells: tuple[ProbeCell, ...]
    skipped: tuple[str, ...] = ()  # regions of the plan without a bucket
    settings: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(c.region for c in self.cells)

    def cell(self, region: str) -> ProbeCell:
        for c in self.cells:
            if c.region == region:
                return c
        raise KeyError(region)

    def to_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "created": self.created,
            "cells": [c.to_dict() for c in self.cells],
            "skipped": list(self.skipped),
            "settings": dict(self.settings),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeResult:
        """Read a result back (e.g. ``--json`` output of other hosts, to draw one matrix of all)."""
        return cls(
            origin=str(d["origin"]),
            created=str(d.get("created", "")),
            cells=tuple(ProbeCell(**c) for c in d["cells"]),
            skipped=tuple(d.get("skipped", ())),
            settings=dict(d.get("settings", {})),
        )
