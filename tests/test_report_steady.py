"""The report's start-up apart from its steady state (trainer/steady.py), on run directories written
here with the loop's own writers: step records, rank summaries with their wall-clock times, and
DiLoCo's round records; the figures are worked out by hand from the times written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report import invoke

from geoshard.trainer.diloco.record import RoundRecord, append, rounds_path
from geoshard.trainer.record import StepRecord, write_steps
from geoshard.trainer.report import build_report
from geoshard.trainer.summary import RankSummary, write_summary

US, EU = "us-east-1", "eu-west-1"


def write_rank(
    run: Path,
    rank: int,
    region: str,
    *,
    started_at: float | None,
    loop_at: float | None,
    first_s: float,
    steps: int = 10,
    sync: str = "hierarchical",
    waits: dict[int, float] | None = None,
) -> None:
    """A first step of ``first_s`` seconds (start-up: little compute), then steps of 0.5 s with 0.45 s
    of compute of which 0.05 s gradient sync: 0.8 utilization; ``waits``: outer-round seconds added
    to those steps (DiLoCo), outside compute."""
    t, records = 0.0, []
    for i in range(steps):
        step = i + 1
        outer = (waits or {}).get(step, 0.0)
        step_s = (first_s if i == 0 else 0.5) + outer
        t += step_s
        compute = 0.1 if i == 0 else 0.45
        records.append(StepRecord(step, rank, t, 0.0, compute, step_s, comm_s=0.05, outer_sync_s=outer, region=region, samples=8))
    write_steps(run / f"steps-rank{rank}.jsonl", records)
    summary = RankSummary(
        rank=rank,
        world_size=2,
        region=region,
        wall_s=t,
        steps=steps,
        samples=8 * steps,
        sync=sync,
        started_at=started_at,
        loop_started_at=loop_at,
    )
    write_summary(run, summary)


def test_startup_runs_until_every_rank_took_its_first_step_and_the_steady_state_follows(tmp_path: Path) -> None:
    # us-east-1's process starts at 1000, its loop at 1003, its first step ends at 1005; eu-west-1's
    # process at 1001, its loop at 1006, its first step at 1007: every rank has stepped at 1007.
    write_rank(tmp_path, 0, US, started_at=1000.0, loop_at=1003.0, first_s=2.0)
    write_rank(tmp_path, 1, EU, started_at=1001.0, loop_at=1006.0, first_s=1.0)
    r = build_report(tmp_path)
    assert r["startup_s"] == pytest.approx(7.0)
    steady = r["utilization_steady"]
    # us-east-1's steps begin at 1005 + 0.5 (i - 1): the 5th of them (step 6) begins at 1007; eu-west-1's steps 2-10 all count.
    assert (steady["steps"], steady["step_from"], steady["step_to"]) == (5 + 9, 2, 10)
    assert steady["share"] == pytest.approx(0.8) and steady["wall_s"] == pytest.approx(14 * 0.5) and not steady["met"]
    # The whole run's figure keeps the start-up: (2 x 0.05 + 18 x 0.4) / (2 + 4.5 + 1 + 4.5).
    assert r["utilization"]["share"] == pytest.approx((2 * 0.05 + 18 * 0.4) / 12.0, abs=1e-6)
    assert steady["excludes"] == "steps before every rank's first step ended"
    done = invoke(tmp_path)
    assert done.exit_code == 0, done.output
    assert (
        "start-up 7.0 s (until every rank took its first step); steady state 80.0% over steps 2-10 "
        "(without steps before every rank's first step ended), target 95%: not met"
    ) in " ".join(done.output.split())


def test_without_wall_clock_times_start_up_is_unknown_and_each_ranks_first_step_is_left_out(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, US, started_at=None, loop_at=None, first_s=2.0)
    write_rank(tmp_path, 1, EU, started_at=1001.0, loop_at=1006.0, first_s=1.0)
    r = build_report(tmp_path)
    assert r["startup_s"] is None
    steady = r["utilization_steady"]
    assert (steady["steps"], steady["step_from"], steady["share"]) == (18, 2, pytest.approx(0.8))
    assert steady["excludes"] == "each rank's first step"
    assert json.loads(json.dumps(r)) == r


def test_diloco_steady_state_leaves_out_the_first_round_until_applied_and_the_last_round(tmp_path: Path) -> None:
    # H = 4, overlap 1, 12 steps: rounds at steps 4, 8, 12, applied at 5, 9 and 12 (the last one waits).
    # Step 5 waits 3 s for round 1 (the other region's late start), step 12 4 s for the last round.
    waits = {5: 3.0, 9: 0.0, 12: 4.0}
    for rank, region, loop_at in ((0, US, 1003.0), (1, EU, 1004.0)):
        write_rank(tmp_path, rank, region, started_at=1000.0, loop_at=loop_at, first_s=1.0, steps=12, sync="diloco", waits=waits)
        for n, step in enumerate((4, 8, 12), start=1):
            applied = step if step == 12 else step + 1
            rec = RoundRecord(n, step, regions=(US, EU), sync_s=waits.get(applied, 0.0), applied_step=applied, region=region, job="j")
            append(rounds_path(tmp_path, region), rec)
    r = build_report(tmp_path)
    assert r["startup_s"] == pytest.approx(5.0)  # eu-west-1's first step ends at 1005
    steady = r["utilization_steady"]
    # Steps 6-11 of each region: after round 1 was applied (step 5), before the last round's step (12).
    assert (steady["steps"], steady["step_from"], steady["step_to"]) == (12, 6, 11)
    assert steady["share"] == pytest.approx(0.8)
    assert steady["excludes"] == (
        "steps before every rank's first step ended, each region's first outer round until applied, and its last round"
    )
    assert r["utilization"]["share"] < 0.6  # the waits at rounds 1 and 3 stay in the whole run's figure
