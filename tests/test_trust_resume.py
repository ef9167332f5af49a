"""Issue 20, part 4 (DiLoCo): ``--resume`` of a DiLoCo job where one region's checkpoints are
missing and the others have theirs is refused in one line naming the region (exit 2), before
anything starts; never that region from step 0 publishing fresh weights as the job's round 0."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_diloco_train import EU, GEOSHARD, US, local_plan

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
