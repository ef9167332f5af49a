"""The step record: one optimizer step of one rank, as the loop writes it to
``RUN_DIR/steps-rank{R}.jsonl``, the report reads it back and the metrics count it. One schema,
here, for all of them, with its one writer (``append_step``) and its one reader (``parse_step``,
``read_steps``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeGuard

from geoshard.errors import DataError

log = logging.getLogger(__name__)

STEP_VERSION = 1  # records without a version are version 1

# Seconds every record has; the rest default to 0 (records of older versions lack them).
REQUIRED_SECONDS = ("t", "data_wait_s", "compute_s", "step_s")
OPTIONAL_SECONDS = ("comm_s", "comm_intra_s", "comm_cross_s", "checkpoint_s", "outer_sync_s")


@dataclass(frozen=True)
class StepRecord:
    step: int
    rank: int
    t: float  # seconds since the loop (this segment of the run) started, at the end of the step
    data_wait_s: float  # blocked in next(loader)
    compute_s: float  # forward, backward (with the gradient sync it overlaps) and optimizer
    step_s: float
    comm_s: float = 0.0  # gradient sync, part of compute_s
    comm_intra_s: float = 0.0  # ... of which inside the region (hierarchical sync)
    comm_cross_s: float = 0.0  # ... of which between region leaders (hierarchical sync)
    checkpoint_s: float = 0.0
    outer_sync_s: float = 0.0  # DiLoCo: this step's outer round (exchange and outer step), apart from compute
    cross_region_grad_bytes: int = 0  # gradient bytes this rank sent to other regions this step
    loss: float | None = None
    samples: int = 0
    region: str | None = None
    segment: int = 0  # restarts and resumes start a new segment; its t counts from its own start

    def to_json(self) -> dict[str, Any]:
        return {"version": STEP_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, rec: Any, where: str, rank: int) -> StepRecord:
        """A record read back; DataError naming ``where`` (file:line) and the field when it is wrong."""
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        version = rec.get("version", 1)
        if not _is_int(version) or version > STEP_VERSION:
            raise DataError(f"{where}: a step record of version {version!r}; this geoshard reads up to {STEP_VERSION}: upgrade it")
        if not _is_int(rec.get("step")):
            raise DataError(f"{where}: step must be an integer, got {rec.get('step')!r}")
        if rec.get("rank", rank) != rank:
            raise DataError(f"{where}: rank {rec['rank']!r} in the file of rank {rank}")
        seconds = {}
        for key in (*REQUIRED_SECONDS, *OPTIONAL_SECONDS):
            value = rec.get(key, None if key in REQUIRED_SECONDS else 0.0)
            if not _is_number(value) or value < 0:
                raise DataError(f"{where}: {key} must be a number of seconds >= 0, got {value!r}")
            seconds[key] = float(value)
        ints = {}
        for key in ("samples", "cross_region_grad_bytes", "segment"):
            value = rec.get(key, 0)
            if not _is_int(value) or value < 0:
                raise DataError(f"{where}: {key} must be an integer >= 0, got {value!r}")
            ints[key] = value
        loss = rec.get("loss")
        if loss is not None and not (isinstance(loss, int | float) and not isinstance(loss, bool)):
            raise DataError(f"{where}: loss must be a number, got {loss!r}")
        region = rec.get("region")
        if region is not None and not isinstance(region, str):
            raise DataError(f"{where}: region must be a string, got {region!r}")
        return cls(
            step=rec["step"],
            rank=rank,
            loss=None if loss is None else float(loss),
            region=region,
            samples=ints["samples"],
            cross_region_grad_bytes=ints["cross_region_grad_bytes"],
            segment=ints["segment"],
            **seconds,
        )


def append_step(f: TextIO, record: StepRecord) -> None:
    """The one writer: a line per record, flushed, so a killed rank still leaves its history."""
    f.write(json.dumps(record.to_json()) + "\n")
    f.flush()


def write_steps(path: Path, records: Iterable[StepRecord]) -> None:
    """The step log anew with ``records`` (a resume forgets the steps it is about to redo)."""
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            append_step(f, r)


def parse_step(line: str | bytes, where: str, rank: int) -> StepRecord:
    """One line of a step log; DataError naming ``where`` when it is not a step record."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    return StepRecord.from_json(rec, where, rank)


def read_steps(path: Path, rank: int) -> list[StepRecord]:
    """The one reader of a step log. A last line cut off mid-write (the rank was writing it, or
    died) is skipped; anything else that is wrong raises DataError naming the file and line."""
    records = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(parse_step(line, f"{path}:{lineno}", rank))
                except DataError as e:
                    if not line.endswith("\n") and isinstance(e.__cause__, json.JSONDecodeError):
                        log.warning("%s:%d: skipping an incomplete last line", path, lineno)
                        break
                    raise
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from e
    return records


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)
