"""The rank summary: what one rank's loop leaves in ``RUN_DIR/rank{R}.json`` when it ends (wall
time, first batch, steps, the loader's counters, where it ran). One record for the training loop
and ``StepLog``, one writer (``write_summary``) and one reader (``read_summary``), which the report uses.

A resume or restart writes the file anew and carries the summaries of the rank's earlier segments
in ``earlier_segments``, so the report counts the whole run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoshard.errors import DataError
from geoshard.loaders.stats import StatsSnapshot

SUMMARY_VERSION = 1  # summaries without a version are version 1


@dataclass(frozen=True)
class LoaderSummary:
    """The loader's ``stats()``: the tier chain's counters and the epoch's remainder."""

    stats: StatsSnapshot
    dropped_samples: int = 0  # per epoch, over the region's ranks
    padded_samples: int = 0
    epoch: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {**self.stats.to_dict(), "dropped_samples": self.dropped_samples, "padded_samples": self.padded_samples}
        return out if self.epoch is None else {**out, "epoch": self.epoch}

    @classmethod
    def from_json(cls, d: Any, where: str) -> LoaderSummary:
        stats = StatsSnapshot.from_dict(d, where)
        assert isinstance(d, Mapping)  # from_dict checked it
        counts = {k: d.get(k, 0) for k in ("dropped_samples", "padded_samples")}
        if not all(_is_int(n) for n in counts.values()):
            raise DataError(f"{where}: loader is not the loader's stats (tiers, egress_bytes, writebacks, dropped_samples)")
        epoch = d.get("epoch")
        return cls(stats, **counts, epoch=epoch if _is_int(epoch) else None)


@dataclass(frozen=True)
class RankSummary:
    rank: int
    world_size: int | None = None
    region: str | None = None
    wall_s: float | None = None  # the loop's wall time in this segment
    time_to_first_batch_s: float | None = None
    steps: int | None = None
    samples: int | None = None
    loader: LoaderSummary | None = None
    gpu_util: float | None = None
    segment: int | None = None  # None: a summary of an older version (the run's only segment)
    # What the training loop adds (StepLog leaves them out).
    backend: str | None = None
    device: str | None = None
    region_rank: int | None = None
    region_size: int | None = None
    sync: str | None = None
    samples_per_epoch: int | None = None
    left_out_per_epoch: int | None = None
    repeated_per_epoch: int | None = None
    region_samples: int | None = None
    earlier_segments: tuple[RankSummary, ...] | None = None
    egress_budget: int | None = None
    utilization_target: float | None = None
    steps_redone: int | None = None
    generations: dict[str, int] | None = None  # epoch -> the generation its region read
    # Wall-clock times (seconds since the epoch): the rank's process start, and its loop's t = 0 in
    # this segment. They put every rank's steps on one time line (report: start-up, steady state).
    started_at: float | None = None
    loop_started_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": SUMMARY_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "loader":
                value = None if value is None else value.to_json()
            elif f.name == "earlier_segments":
                if value is None:
                    continue
                value = [s.to_json() for s in value]
            elif value is None and f.name not in _ALWAYS:
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, d: Any, where: str, rank: int) -> RankSummary:
        """A summary read back; DataError naming ``where`` when what the report relies on is wrong.
        Fields of another type than their own are left out (None), as the report never needed them."""
        if not isinstance(d, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(d).__name__}")
        version = d.get("version", 1)
        if not _is_int(version) or version > SUMMARY_VERSION:
            raise DataError(f"{where}: a rank summary of version {version!r}; this geoshard reads up to {SUMMARY_VERSION}: upgrade it")
        if d.get("rank", rank) != rank:
            raise DataError(f"{where}: rank {d['rank']!r} in the file of rank {rank}")
        if "wall_s" in d and (not _is_number(d["wall_s"]) or d["wall_s"] < 0):
            raise DataError(f"{where}: wall_s must be a number of seconds >= 0, got {d['wall_s']!r}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("rank", "loader", "earlier_segments"):
                continue
            value = d.get(f.name)
            values[f.name] = value if _KINDS[f.name](value) else None
        loader = None if d.get("loader") is None else LoaderSummary.from_json(d["loader"], where)
        earlier = d.get("earlier_segments")
        segments = None
        if isinstance(earlier, list):
            segments = tuple(cls.from_json(e, where, rank) for e in earlier if isinstance(e, dict))
        return cls(rank=rank, loader=loader, earlier_segments=segments, **values)


_ALWAYS = ("world_size", "region", "wall_s", "time_to_first_batch_s", "steps", "samples", "gpu_util")


def write_summary(run_dir: Path, summary: RankSummary) -> Path:
    """The one writer: RUN_DIR/rank{R}.json."""
    path = run_dir / f"rank{summary.rank}.json"
    path.write_text(json.dumps(summary.to_json(), indent=1))
    return path


def read_summary(path: Path, rank: int) -> RankSummary:
    """The one reader: DataError naming the file when it is not a rank summary."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from e
    return RankSummary.from_json(data, str(path), rank)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_generations(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _is_int(g) and g >= 0 for k, g in v.items())


_INT_FIELDS = (
    "world_size",
    "steps",
    "samples",
    "segment",
    "region_rank",
    "region_size",
    "samples_per_epoch",
    "left_out_per_epoch",
    "repeated_per_epoch",
    "region_samples",
    "egress_budget",
    "steps_redone",
)
_KINDS = {
    **{k: _is_int for k in _INT_FIELDS},
    **{k: _is_number for k in ("wall_s", "time_to_first_batch_s", "gpu_util", "utilization_target", "started_at", "loop_started_at")},
    **{k: _is_str for k in ("region", "backend", "device", "sync")},
    "generations": _is_generations,
}
