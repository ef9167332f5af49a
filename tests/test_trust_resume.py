"""Issue 20, part 4 (DiLoCo): ``--resume`` of a DiLoCo job where one region's checkpoints are
missing and the others have theirs is refused in one line naming the region (exit 2), before
anything starts; never that region from step 0 publishing fresh weights as the job's round 0."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_diloco_train import EU, GEOSHARD, US, local_plan

from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.resume import checked_momentum

FLAGS = ("--batch-size", "16", "--num-workers", "1", "--backend", "gloo", "--sync", "diloco", "--outer-steps", "5")


def train(plan: Path, out: Path, *args: object) -> subprocess.CompletedProcess[str]:
    argv = [GEOSHARD, "train", "--plan", str(plan), "--regions", f"{US}:1,{EU}:1", "--out", str(out), *FLAGS, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=400)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_diloco_resume_without_one_regions_checkpoints_is_refused(tmp_path: Path) -> None:
    plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=1200)
    out = tmp_path / "run"
    first = train(plan, out, "--steps", "10", "--checkpoint-every", "5")
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(out / "checkpoints" / US)
    before = snapshot(out)
    r = train(plan, out, "--steps", "15", "--resume")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert lines[0].startswith(f"geoshard: error: --resume: no checkpoint for region {US} under {out / 'checkpoints'} ({EU} has theirs)")
    assert "restore its checkpoints, or start the job over with --overwrite" in lines[0]
    assert snapshot(out) == before  # nothing started: no step, round, log or checkpoint written or removed


@pytest.mark.slow
def test_diloco_resume_with_every_regions_checkpoints_goes_on(tmp_path: Path) -> None:
    plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=1200)
    out = tmp_path / "run"
    assert train(plan, out, "--steps", "10", "--checkpoint-every", "5").returncode == 0
    r = train(plan, out, "--steps", "15", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed at step 10" in (out / "logs" / "stderr.log").read_text()
    # A new store: round 0 again, us-east-1's checkpointed parameters peer to peer (the default
    # transport), the store carrying membership and rendezvous only.
    for region in (US, EU):
        recs = [json.loads(x) for x in (out / f"rounds-{region}.jsonl").read_text().splitlines()]
        join = [x for x in recs if x["event"] == "join"][-1]
        assert join["step"] == 10 and join["round"] == 0 and join["created"] == (region == US), join
        assert join["transport"] == "p2p" and 0 < join["store_bytes"] < 1_000_000, join


@pytest.mark.slow
def test_a_p2p_job_resumed_on_other_rank_counts_reshards_round_0_and_its_regions_stay_together(tmp_path: Path) -> None:
    """Saved on us-east-1:2, eu-west-1:1, resumed on us-east-1:1, eu-west-1:2: round 0 takes
    us-east-1's checkpointed parameters peer to peer cut by the new layout (each eu-west-1 rank
    its half), and both regions hold the same parameters after every later round."""
    plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=1200)
    out = tmp_path / "run"
    argv = [GEOSHARD, "train", "--plan", str(plan), "--out", str(out), *FLAGS, "--checkpoint-every", "5"]
    before = [*argv, "--regions", f"{US}:2,{EU}:1", "--steps", "10"]
    first = subprocess.run(before, capture_output=True, text=True, timeout=400, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    again = [*argv, "--regions", f"{US}:1,{EU}:2", "--steps", "20", "--resume"]
    r = subprocess.run(again, capture_output=True, text=True, timeout=400, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "logs" / "stderr.log").read_text()
    assert f"{US}: epoch 0 resumes on 1 rank(s) of the region (saved on 2)" in log
    assert f"{EU}: epoch 0 resumes on 2 rank(s) of the region (saved on 1)" in log
    recs = {g: [json.loads(x) for x in (out / f"rounds-{g}.jsonl").read_text().splitlines()] for g in (US, EU)}
    joins = {g: [x for x in recs[g] if x["event"] == "join"] for g in (US, EU)}
    assert [len(joins[g]) for g in (US, EU)] == [2, 2], joins
    for g in (US, EU):
        join = joins[g][1]
        assert (join["round"], join["step"], join["created"], join["transport"]) == (0, 10, g == US, "p2p"), join
        assert 0 < join["store_bytes"] < 1_000_000, join
        later = [x for x in recs[g] if x["event"] == "round" and x["job"] == join["job"]]
        assert [x["round"] for x in later] == [1, 2], later
        assert all(x["regions"] == [US, EU] and not x["adopted"] and x["steps_lost"] == 0 for x in later), later
        assert all(x["store_bytes"] < 1_000_000 for x in later), later
    # eu-west-1's leader took its shard of the fp32 state: a fresh job's parameters on its one rank
    # (4 bytes each), then on resume half of the parameters and half of the outer momentum on two
    assert joins[EU][0]["bytes_read"] > 0 and joins[EU][1]["bytes_read"] == joins[EU][0]["bytes_read"], joins[EU]
    assert joins[US][1]["bytes_read"] == 0
    for step in (15, 20):  # checkpoints written at the rounds: the regions' parameters are the same
        us, eu = (torch.load(out / "checkpoints" / g / f"ckpt-{step:09d}.pt", weights_only=False)["model"] for g in (US, EU))
        assert list(us) == list(eu) and all(torch.equal(us[k], eu[k]) for k in us), step


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "regions"), [("p2p", f"{US}:2,{EU}:1"), ("store", f"{US}:1,{EU}:1")])
def test_a_whole_job_resumed_at_a_round_continues_exactly_as_if_it_had_never_stopped(transport: str, regions: str, tmp_path: Path) -> None:
    """15 steps straight, against 10 steps, every region stopped, and ``--resume`` to 15 (H=5, a
    checkpoint at each round): the same parameters and outer momentum, bit for bit. The checkpoint
    keeps the outer momentum (under p2p gathered from its owners) and round 0 hands the first
    region's to every region; before, it started from zero and the runs parted at the next round."""
    plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=1200)
    argv = [GEOSHARD, "train", "--plan", str(plan), "--regions", regions, *FLAGS, "--checkpoint-every", "5", "--outer-transport", transport]

    def run(out: Path, *args: str) -> None:
        done = subprocess.run([*argv, "--out", str(out), *args], capture_output=True, text=True, timeout=400, check=False)
        assert done.returncode == 0, done.stderr[-3000:]

    run(tmp_path / "straight", "--steps", "15")
    run(tmp_path / "stopped", "--steps", "10")
    run(tmp_path / "stopped", "--steps", "15", "--resume")
    for g in (US, EU):
        a, b = (torch.load(tmp_path / r / "checkpoints" / g / "ckpt-000000015.pt", weights_only=True) for r in ("straight", "stopped"))
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), g
        momentum = a["outer"]["momentum"]
        assert momentum is not None and float(momentum.abs().sum()) > 0 and torch.equal(momentum, b["outer"]["momentum"]), g
        resumed = torch.load(tmp_path / "stopped" / "checkpoints" / g / "ckpt-000000010.pt", weights_only=True)
        assert not torch.equal(resumed["outer"]["momentum"], momentum)  # it moved on from the resumed one


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (torch.zeros(5), "malformed: the outer momentum must be float32 of shape (4,), got torch.float32 of shape (5,)"),
        (
            torch.zeros(4, dtype=torch.float64),
            "malformed: the outer momentum must be float32 of shape (4,), got torch.float64 of shape (4,)",
        ),
        ([0.0] * 4, "malformed: the outer momentum must be float32 of shape (4,), got list"),
        (torch.tensor([0.0, float("nan"), float("inf"), 1.0]), "non-finite: 2 of the outer momentum's values are NaN or infinite"),
    ],
)
def test_a_checkpoints_outer_momentum_is_checked_before_use(value: object, why: str) -> None:
    with pytest.raises(Refused) as e:
        checked_momentum(value, 4)
    assert str(e.value) == why
    good = torch.tensor([1.0, -2.0, 0.0, 3.5])
    assert torch.equal(checked_momentum(good, 4), good) and checked_momentum(good, 4) is not good
