"""Issue 22, your own loop on your own data: a corpus written with webdataset's ``ShardWriter``
(keys ``img_000123``, fields ``jpg``, ``cls``, ``json``), split by a plan, read by the README's
StepLog loop under torchrun, by a loop that breaks early, and by torch's own DataLoader with
persistent workers; each run as the user runs it, its whole output checked."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGIONS = ("us-east-1", "eu-west-1", "ap-southeast-1")


def geoshard(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GEOSHARD_") and k not in ("COLUMNS", "PYTHONPATH")}
    return subprocess.run([GEOSHARD, *map(str, args)], capture_output=True, text=True, timeout=300, env=environ, cwd=cwd, check=False)


def make_own_corpus(tmp: Path, samples: int = 3000) -> Path:
    """An ordinary WebDataset made with webdataset's ShardWriter, split for three regions into
    local folders; the plan's path."""
    import webdataset as wds

    (tmp / "corpus").mkdir(parents=True)
    rng = random.Random(0)
    with wds.ShardWriter(str(tmp / "corpus" / "part-%04d.tar"), maxcount=500, verbose=0) as w:
        for i in range(samples):
            jpg = b"\xff\xd8\xff\xe0" + rng.randbytes(rng.randint(300, 2500))  # any length, as real images
            w.write({"__key__": f"img_{i:06d}", "jpg": jpg, "cls": i % 10, "json": {"origin": REGIONS[i % 3], "i": i}})
    plan = tmp / "plan.toml"
    plan.write_text('[shards]\nbytes = "256KB"\n' + "".join(f'[regions.{r}]\nweight = 1\nlocal = "{tmp / "split" / r}"\n' for r in REGIONS))
    r = geoshard("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return plan


@pytest.fixture(scope="module")
def own_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_own_corpus(tmp_path_factory.mktemp("own"))


def region_samples(plan: Path, region: str) -> int:
    return int(json.loads((plan.parent / "split" / region / "manifest.json").read_text())["samples"])


def python(code: str, *args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -W error -c CODE ARGS``: any warning fails the run."""
    return subprocess.run(
        [sys.executable, "-P", "-W", "error", "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        check=False,
    )


@pytest.mark.slow
def test_the_readme_loop_under_torchrun_is_reported_whole(own_plan: Path, tmp_path: Path) -> None:
    (tmp_path / "plan.toml").write_text(own_plan.read_text())
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)} | {"GEOSHARD_REGION": "eu-west-1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    p = subprocess.run(
        [*argv, ROOT / "tests" / "jobs" / "readme_loop.py", ROOT / "README.md", "40"],
        capture_output=True,
        text=True,
        timeout=300,
        env=environ | {"PYTHONWARNINGS": "error::UserWarning"},  # torch warns about float() of a tensor that requires grad
        cwd=tmp_path,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == "" and "Warning" not in p.stderr, p.stderr[-3000:]
    r = geoshard("report", "runs/mine", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    per_rank = region_samples(own_plan, "eu-west-1") // 2
    epoch = [64] * (per_rank // 64) + ([per_rank % 64] if per_rank % 64 else [])
    assert len(epoch) < 40  # more than one epoch: stream() went on across the boundaries
    samples = 2 * sum((epoch * 40)[:40])
    assert (report["steps"], report["samples"], report["complete"]) == (40, samples, True)
    assert report["loss_first"] is not None and report["loss_last"] is not None
    r = geoshard("report", "runs/mine", cwd=tmp_path)
    assert f"2 rank(s) in eu-west-1, 40 steps (1..40), {samples:,} samples, loss " in r.stdout, r.stdout
    run = json.loads((tmp_path / "runs" / "mine" / "run.json").read_text())
    assert run["world_size"] == 2 and re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", run["run_id"])


_BREAKS = """
import sys
import torch
from geoshard.loaders import make_loader
from geoshard.trainer.steplog import StepLog

loader = make_loader(sys.argv[1], region="eu-west-1", batch_size=16, num_workers=1, seed=0)
model = torch.nn.Linear(4, 1)
with StepLog(sys.argv[2], loader, resume=sys.argv[3] == "resume") as steps:
    for batch in steps.stream():
        loss = model(torch.ones(len(batch["__key__"]), 4)).pow(2).mean()
        loss.backward()
        steps.note(loss=loss)  # a tensor that requires grad
        if steps.step == int(sys.argv[4]):
            break
print(steps.run_id, steps.step)
"""


@pytest.mark.slow
def test_a_loop_that_breaks_records_its_last_step_and_another_run_is_refused(own_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    p = python(_BREAKS, own_plan, out, "new", 40)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    run_id, step = p.stdout.split()
    assert step == "40"
    r = geoshard("report", out)
    assert r.returncode == 0, r.stderr
    assert "1 rank(s) in eu-west-1, 40 steps (1..40), 640 samples, loss " in r.stdout, r.stdout

    # another run into the same folder: refused in one line naming the folder and the run's id
    p = python(_BREAKS, own_plan, out, "new", 5)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last == (
        f"geoshard.errors.ConfigError: {out}: holds another run (run {run_id}: rank0.json, report.json, steps-rank0.jsonl); "
        "pass resume=True to StepLog to append to it, or choose another folder"
    ), p.stderr
    assert len((out / "steps-rank0.jsonl").read_text().splitlines()) == 40  # untouched

    # resume=True appends to that run: a second segment, steps counting on
    p = python(_BREAKS, own_plan, out, "resume", 50)
    assert p.returncode == 0 and p.stderr == "" and p.stdout.split() == [run_id, "50"], p.stderr[-3000:]
    r = geoshard("report", out)
    line = next(x for x in r.stdout.splitlines() if x.startswith("1 rank(s) in eu-west-1, "))
    assert "50 steps (1..50) in 2 segments" in line and ", 800 samples, loss " in line, r.stdout


_PERSISTENT = """
import sys
from torch.utils.data import DataLoader
from geoshard.loaders import RegionalDataset

def keys(loader):
    return [k for b in loader for k in b["__key__"]]

mine = RegionalDataset(sys.argv[1], region="eu-west-1", seed=0)
persistent = DataLoader(mine, batch_size=8, num_workers=2, persistent_workers=True)
got, want = [], []
for epoch in range(3):
    mine.set_epoch(epoch)
    got.append(keys(persistent))
    fresh = RegionalDataset(sys.argv[1], region="eu-west-1", seed=0)
    fresh.set_epoch(epoch)
    want.append(keys(DataLoader(fresh, batch_size=8, num_workers=2)))
print(got == want, len({tuple(k) for k in got}), [len(k) for k in got])
"""


@pytest.mark.slow
def test_torch_dataloader_with_persistent_workers_reads_each_epochs_own_order(own_plan: Path) -> None:
    p = python(_PERSISTENT, own_plan)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    n = region_samples(own_plan, "eu-west-1")
    assert p.stdout == f"True 3 [{n}, {n}, {n}]\n"
