"""A process group of one rank exchanges no gradients: no DDP, no hook, ``comm_s`` 0 because
nothing runs (trainer/comm.py ``for_sync``); a group of two still all-reduces. Real torchrun and
gloo, and ``geoshard train --regions`` under DiLoCo with a one-rank and a two-rank region."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_diloco_train import EU, US, lines, local_plan, train_argv
from test_multiregion import torchrun

ROOT = Path(__file__).resolve().parents[1]


def job(tmp: Path, nproc: int) -> list[dict[str, object]]:
    out = tmp / f"n{nproc}"
    out.mkdir()
    done = torchrun(ROOT / "tests" / "jobs" / "one_rank_sync.py", nproc, out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_a_group_of_one_rank_runs_no_ddp_and_a_group_of_two_all_reduces(tmp_path: Path) -> None:
    [one] = job(tmp_path, 1)
    assert one["ddp"] is False and one["take"] == [0.0, 0.0, 0.0, 0]
    assert one["to_own_batch"] == 0.0 and one["scale"] > 0  # the model's own gradients, untouched
    for r in job(tmp_path, 2):
        assert r["ddp"] is True
        seconds, _, _, cross_bytes = r["take"]  # type: ignore[misc]
        assert seconds > 0 and cross_bytes == 0  # one region: the ring never leaves it
        tol = 1e-6 * r["scale"]  # type: ignore[operator]
        assert r["between_ranks"] <= tol and r["to_mean_of_ranks"] <= tol, r
        assert r["to_own_batch"] > 100 * tol, r  # the batches differ: equal gradients come from the all-reduce


@pytest.mark.slow
def test_under_diloco_a_one_rank_region_reports_no_gradient_sync_and_a_two_rank_region_does(tmp_path: Path) -> None:
    plan = local_plan(tmp_path, {US: 2, EU: 1}, samples=2000)
    out = tmp_path / "run"
    steps = 20
    argv = train_argv(plan, out, f"{US}:2,{EU}:1", "--steps", steps, "--outer-steps", 10, "--hidden", 256)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert {r: ranks[r]["region"] for r in ranks} == {0: US, 1: US, 2: EU}
    steps_of = {r: lines(out / f"steps-rank{r}.jsonl") for r in ranks}
    assert all(len(s) == steps for s in steps_of.values())
    # eu-west-1 has one rank: no step spent anything on a gradient exchange, and its summary says so.
    assert all(x["comm_s"] == 0 and x["comm_intra_s"] == 0 and x["comm_cross_s"] == 0 for x in steps_of[2])
    assert ranks[2]["comm_s"] == 0
    # us-east-1's two ranks all-reduce at every step.
    for r in (0, 1):
        assert all(x["comm_s"] > 0 for x in steps_of[r]) and ranks[r]["comm_s"] > 0
    # The report's figures are the step records' own: the mean sync per step and rank, and
    # utilization as compute without sync over wall.
    records = [x for s in steps_of.values() for x in s]
    assert report["grad_sync_s_per_step"] == pytest.approx(sum(x["comm_s"] for x in records) / len(records), abs=1e-6)
    u = report["utilization"]
    compute = sum(max(0.0, g["compute_s"] - g["comm_s"]) for g in ranks.values())
    assert u["share"] == pytest.approx(compute / sum(g["wall_s"] for g in ranks.values()), abs=1e-4)
    assert "gradient sync diloco: " in done.stdout
