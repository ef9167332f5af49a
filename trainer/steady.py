"""Start-up apart from the steady state, for the report.

- ``startup_s``: from the earliest rank's process start to the moment the last rank ended its
  first step (under DiLoCo: until every region took its first step). It needs every rank's
  summary of the run's first segment with its wall-clock times (``RankSummary.started_at``,
  ``loop_started_at``); otherwise None.
- ``utilization_steady``: the report's compute utilization (compute without gradient exchange
  over wall, summed over ranks) over the steps that began after that moment. Under DiLoCo it
  also leaves out each region's steps up to the step at which it applied its first outer round
  (``applied_step``: the round's step plus ``--outer-overlap``) and from its last round's step
  on: the first round waits for the slowest region's start, the last one for the others' ends.
  A step's wall is the time since the end of the step before it in the same segment (the first
  step of a segment: since the segment's loop began), so the window's walls add up exactly.
  Without wall-clock times (an older run, or your own loop's ``StepLog``) only the DiLoCo bounds
  and each rank's first step are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from geoshard.trainer.diloco.record import RoundRecord
from geoshard.trainer.rundir import RankRun, segment_summaries, segments


@dataclass(frozen=True)
class _Window:
    """The steps of a region that count as steady: ``low < step < high`` (None: unbounded)."""

    low: int = 0
    high: int | None = None

    def holds(self, step: int) -> bool:
        return step > self.low and (self.high is None or step < self.high)


def startup_s(runs: Mapping[int, RankRun]) -> float | None:
    """Seconds from the earliest rank's process start until every rank ended its first step."""
    line = _first_steps(runs)
    if line is None or any(start is None for start, _ in line):
        return None
    return round(max(end for _, end in line) - min(start for start, _ in line if start is not None), 6)


def _first_steps(runs: Mapping[int, RankRun]) -> list[tuple[float | None, float]] | None:
    """Per rank, on the wall clock: its process start and the end of its first step in the run's
    first segment; None when a rank's summary of that segment or its loop's start is missing."""
    out = []
    for run in runs.values():
        segs = segments(run)
        if not segs:
            return None
        s = segment_summaries(run).get(min(segs))
        if s is None or s.loop_started_at is None:
            return None
        out.append((s.started_at, s.loop_started_at + segs[min(segs)][0].t))
    return out or None


def diloco_windows(rounds: Iterable[RoundRecord]) -> dict[str, _Window]:
    """Per region: after its first round was applied, before its last round's step."""
    by_region: dict[str, list[RoundRecord]] = {}
    for rec in rounds:
        if rec.event == "round":
            by_region.setdefault(rec.region, []).append(rec)
    out = {}
    for region, recs in by_region.items():
        first, last = min(recs, key=lambda r: r.step), max(recs, key=lambda r: r.step)
        out[region] = _Window(max(first.step, first.applied_step), last.step)
    return out


def steady_utilization(
    runs: Mapping[int, RankRun], rounds: Iterable[RoundRecord], target: float, sync: str | None
) -> dict[str, Any] | None:
    """The steady state's utilization (None: no step in it)."""
    windows = diloco_windows(rounds) if sync == "diloco" else {}
    line = _first_steps(runs)
    since = max(end for _, end in line) if line else None  # every rank took its first step
    compute = wall = 0.0
    counted, lows, highs = 0, [], []
    for run in runs.values():
        summaries = segment_summaries(run)
        for seg, steps in segments(run).items():
            s = summaries.get(seg)
            origin = s.loop_started_at if s is not None else None
            window = windows.get(steps[0].region or "", _Window()) if sync == "diloco" else _Window()
            before = 0.0  # the end of the previous step, in the segment's loop time
            for i, x in enumerate(steps):
                began = before
                before = x.t
                if i == 0 and (since is None or origin is None):
                    continue  # no time line: the first step carries the start-up
                if since is not None and origin is not None and origin + began < since:
                    continue
                if sync == "diloco" and not window.holds(x.step):
                    continue
                compute += max(0.0, x.compute_s - x.comm_s)
                wall += x.t - began
                counted += 1
                lows.append(x.step)
                highs.append(x.step)
    if counted == 0 or wall <= 0:
        return None
    share = round(min(1.0, compute / wall), 6)
    return {
        "share": share,
        "compute_s": round(compute, 6),
        "wall_s": round(wall, 6),
        "target": target,
        "met": share >= target,
        "steps": counted,  # step records counted, over all ranks
        "step_from": min(lows),
        "step_to": max(highs),
        "excludes": _excludes(since is not None, sync == "diloco" and bool(windows)),
    }


def _excludes(timeline: bool, rounds: bool) -> str:
    head = "steps before every rank's first step ended" if timeline else "each rank's first step"
    return head + (", each region's first outer round until applied, and its last round" if rounds else "")
