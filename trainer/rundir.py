"""What a training run left in RUN_DIR, per rank and per segment, read through the records' own
readers (``record.read_steps``, ``summary.read_summary``).

- ``steps-rank{R}.jsonl``: one ``StepRecord`` per optimizer step of rank R;
- ``rank{R}.json``: the rank's ``RankSummary``, written when its loop ends.

A resumed or restarted run has several segments (``segment`` in each step record, ``t`` counting
from the segment's start; ``earlier_segments`` in the rank summary). A rank without its summary
(still running, or died) is measured from its steps: its wall time is the end of its last step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from geoshard.errors import ConfigError, DataError
from geoshard.trainer.record import StepRecord, read_steps
from geoshard.trainer.summary import RankSummary, read_summary

_STEPS_FILE = re.compile(r"^steps-rank(\d+)\.jsonl$")
_SUMMARY_FILE = re.compile(r"^rank(\d+)\.json$")


@dataclass(frozen=True)
class RankRun:
    """What one rank left in RUN_DIR: its validated step records and its summary (None if absent)."""

    rank: int
    steps: tuple[StepRecord, ...]
    summary: RankSummary | None


def read_run(run_dir: str | Path) -> dict[int, RankRun]:
    """Every rank's files in ``run_dir``, by rank. Raises DataError naming the file that is wrong."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ConfigError(f"{d}: no such run directory")
    steps_files: dict[int, Path] = {}
    summary_files: dict[int, Path] = {}
    for p in d.iterdir():
        if m := _STEPS_FILE.match(p.name):
            steps_files[int(m.group(1))] = p
        elif m := _SUMMARY_FILE.match(p.name):
            summary_files[int(m.group(1))] = p
    if not steps_files and not summary_files:
        raise DataError(f"{d}: no steps-rank*.jsonl or rank*.json files; is this the run directory of a geoshard training run?")
    runs = {}
    for rank in sorted(steps_files.keys() | summary_files.keys()):
        if rank not in steps_files:
            raise DataError(f"{d / f'steps-rank{rank}.jsonl'}: missing, but {summary_files[rank].name} is there")
        summary = read_summary(summary_files[rank], rank) if rank in summary_files else None
        runs[rank] = RankRun(rank=rank, steps=tuple(read_steps(steps_files[rank], rank)), summary=summary)
    return runs


def segments(run: RankRun) -> dict[int, list[StepRecord]]:
    """The rank's step records by segment (first run, then each resume or restart), in order."""
    out: dict[int, list[StepRecord]] = {}
    for x in run.steps:
        out.setdefault(x.segment, []).append(x)
    return dict(sorted(out.items()))


def segment_summaries(run: RankRun) -> dict[int, RankSummary]:
    """The rank's summaries by segment: the last one written, and the earlier ones it carries."""
    if run.summary is None:
        return {}
    last = max((x.segment for x in run.steps), default=0)
    out: dict[int, RankSummary] = {}
    for s in [*(run.summary.earlier_segments or ()), run.summary]:
        out[s.segment if s.segment is not None else last] = s  # summaries of older versions: the run's only segment
    return out


def segment_walls(run: RankRun) -> dict[int, float]:
    """Each segment's wall time: its summary's when the rank finished it, else its last step's end."""
    summaries = segment_summaries(run)
    walls = {}
    for seg, steps in segments(run).items():
        s = summaries.get(seg)
        wall = s.wall_s if s is not None else None
        # Same clock for both, so a wall time shorter than the last step's end is rounding only.
        walls[seg] = max(float(wall), steps[-1].t) if wall is not None else steps[-1].t
    return walls


def wall(run: RankRun) -> float:
    """The loop's wall time over every segment of the run."""
    if not run.steps:
        w = run.summary.wall_s if run.summary is not None else None
        return float(w) if w is not None else 0.0
    return sum(segment_walls(run).values())


def after_first_batch(run: RankRun) -> tuple[float, float]:
    """(data wait, wall) of the rank after the first step of each segment: without startups and
    their cold first fetches."""
    walls = segment_walls(run)
    wait = sum(x.data_wait_s for steps in segments(run).values() for x in steps[1:])
    return wait, sum(walls[seg] - steps[0].t for seg, steps in segments(run).items())


def all_summaries(summaries: Iterable[RankSummary]) -> list[RankSummary]:
    """Rank summaries with the earlier segments each carries: loader counters of the whole run."""
    out: list[RankSummary] = []
    for s in summaries:
        out += s.earlier_segments or ()
        out.append(s)
    return out
