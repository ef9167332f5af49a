"""Issue 19 under torchrun: a refresh published while a two-region job trains. With
--follow-refresh every epoch reads one generation in all regions and the epoch after the switch
reads the new samples once; without it the job finishes on its pinned generation, also while
``refresh --delete`` prunes that generation (the job's lease keeps it readable). Keys logged with
--log-keys."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from genkit import EU, US, add_source, bucket_of, gen_plan, keys_by_epoch, refresh
from killkit import finish
from servers import SeaweedS3
from synckit import cli, objects

from geoshard.manifest import read_region_manifest
from geoshard.manifest.lease import LEASES

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
FIRST, ADDED = 160, 32  # samples per region: 10 batches of 16 per epoch, then 12


def _train(plan: Path, out: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    argv = [GEOSHARD, "train", "--plan", str(plan), "--regions", f"{US}:1,{EU}:1", "--out", str(out), "--steps", str(steps)]
    argv += ["--batch-size", "16", "--num-workers", "1", "--backend", "gloo", "--log-keys", "--model", "none", "--step-time", "0.25"]
    return subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out.parent)


def _wait_for_steps(out: Path, n: int, job: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until rank 0 logged ``n`` steps (the job is training on its first generation)."""
    deadline = time.monotonic() + timeout
    log = out / "keys-rank0.jsonl"
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= n:
            return
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps logged in {timeout} s")


def _first_generation(tmp: Path, server: SeaweedS3) -> tuple[Path, Path, Path, set[str]]:
    """A plan, generation 1 published from ``FIRST`` samples: (plan, sources, run folder, its keys)."""
    plan = gen_plan(tmp, server, local=False)
    src, out = tmp / "src", tmp / "run"
    old = add_source(src, "a", FIRST)
    refresh(src, plan, tmp / "split")
    out.mkdir()
    return plan, src, out, old


@pytest.mark.slow
def test_a_refresh_reaches_every_region_at_one_epoch_boundary_with_follow_refresh(aws: SeaweedS3, tmp_path: Path) -> None:
    plan, src, out, old = _first_generation(tmp_path, aws)
    job = _train(plan, out, 70, "--follow-refresh")
    _wait_for_steps(out, 3, job)
    new = add_source(src, "b", ADDED)
    assert refresh(src, plan, tmp_path / "split")["split"]["generation"] == 2
    finish(job, out)

    seen = keys_by_epoch(out)
    epochs = sorted({e for _, e in seen})
    by_epoch = {}
    for e in epochs:
        gens = [seen[(r, e)][0] for r in (US, EU)]
        assert all(len(g) == 1 for g in gens) and gens[0] == gens[1], (e, gens)  # one generation, in every region
        by_epoch[e] = next(iter(gens[0]))
    assert by_epoch[0] == 1 and list(by_epoch.values()) == sorted(by_epoch.values()) and 2 in by_epoch.values(), by_epoch
    switch = min(e for e, g in by_epoch.items() if g == 2)
    assert switch < epochs[-1], "the run ended in the switching epoch"
    for r in (US, EU):
        for e in epochs[:-1]:  # complete epochs: every key of their generation exactly once
            counts = seen[(r, e)][1]
            assert set(counts) == (old | new if by_epoch[e] == 2 else old) and max(counts.values()) == 1, (r, e)
    report = json.loads((out / "report.json").read_text())
    for r in (US, EU):
        assert {int(e): g for e, g in report["regions"][r]["generations"].items()} == by_epoch


@pytest.mark.slow
def test_without_follow_refresh_the_job_finishes_on_its_pinned_generation_while_delete_prunes_it(aws: SeaweedS3, tmp_path: Path) -> None:
    plan, src, out, old = _first_generation(tmp_path, aws)
    split = tmp_path / "split"
    first = {r: read_region_manifest(split / r) for r in (US, EU)}
    job = _train(plan, out, 50)
    _wait_for_steps(out, 3, job)
    for n in (120, 112):  # two nightly refreshes with --delete: the source changes, its old shards are pruned
        add_source(src, "a", n)
        refresh(src, plan, split, "--delete", "--keep-generations", "0")
    for r in (US, EU):  # shards only generation 1 names: pruned but for the job's lease
        only_first = {s.path for s in first[r].shards} - {s.path for s in read_region_manifest(split / r).shards}
        assert only_first and all(f"train/{p}" in objects(aws, bucket_of(plan, r)) for p in only_first), r
    text = finish(job, out)
    assert "NoSuchKey" not in text
    seen = keys_by_epoch(out)
    epochs = sorted({e for _, e in seen})
    assert len(epochs) >= 3
    for r in (US, EU):
        for e in epochs:
            gens, counts = seen[(r, e)]
            assert gens == {1}, (r, e, gens)
            if e != epochs[-1]:
                assert set(counts) == old and max(counts.values()) == 1, (r, e)
    report = json.loads((out / "report.json").read_text())
    assert set(report["regions"][US]["generations"].values()) == {1}
    for r in (US, EU):  # what kept generation 1: the job's lease in each region's bucket
        assert any(k.startswith(f"train/{LEASES}/run-") for k in objects(aws, bucket_of(plan, r))), r


@pytest.mark.slow
def test_a_resume_after_a_refresh_ends_its_epoch_on_the_checkpoints_generation_then_follows(aws: SeaweedS3, tmp_path: Path) -> None:
    plan, src, out, old = _first_generation(tmp_path, aws)
    split = tmp_path / "split"
    finish(_train(plan, out, 15, "--checkpoint-every", "5"), out)  # stops in epoch 1 (10 steps per epoch)
    new = add_source(src, "b", ADDED)
    refresh(src, plan, split)
    text = finish(_train(plan, out, 45, "--checkpoint-every", "5", "--resume", "--follow-refresh"), out)
    assert text.count("resumed at step 15") == 2, text[-3000:]
    seen = keys_by_epoch(out)
    epochs = sorted({e for _, e in seen})
    for r in (US, EU):
        assert [next(iter(seen[(r, e)][0])) for e in epochs] == [1, 1] + [2] * (len(epochs) - 2), (r, epochs)
        for e in epochs[:-1]:  # epoch 1 over both runs, then the new generation's: every key once
            counts = seen[(r, e)][1]
            assert set(counts) == (old if e < 2 else old | new) and max(counts.values()) == 1, (r, e)
    assert len(epochs) >= 4


@pytest.mark.slow
def test_regions_published_apart_train_on_the_generation_all_have_and_a_stale_replica_is_refreshed(aws: SeaweedS3, tmp_path: Path) -> None:
    plan = gen_plan(tmp_path, aws)  # with local replicas
    src, split = tmp_path / "src", tmp_path / "split"
    old = add_source(src, "a", FIRST)
    refresh(src, plan, split)
    replica = {r: tmp_path / "replica" / r for r in (US, EU)}
    for r in (US, EU):
        assert cli("pull", "--plan", plan, "--region", r, "--to", replica[r]).exit_code == 0
    new = add_source(src, "b", ADDED)
    refresh(src, plan, split, "--region", EU)  # generation 2 reaches eu-west-1 only, and its replica
    assert cli("pull", "--plan", plan, "--region", EU, "--to", replica[EU]).exit_code == 0

    first = tmp_path / "first"
    first.mkdir()
    finish(_train(plan, first, 12), first)
    report = json.loads((first / "report.json").read_text())
    assert {r: report["regions"][r]["generations"] for r in (US, EU)} == {US: {"0": 1, "1": 1}, EU: {"0": 1, "1": 1}}
    assert set(keys_by_epoch(first)[(EU, 0)][1]) == old  # eu-west-1 read generation 1 (its bucket's history copy)

    refresh(src, plan, split)  # now us-east-1's bucket too; its replica stays on generation 1
    assert read_region_manifest(replica[US]).generation == 1
    second = tmp_path / "second"
    second.mkdir()
    finish(_train(plan, second, 12), second)
    report = json.loads((second / "report.json").read_text())
    assert {r: set(report["regions"][r]["generations"].values()) for r in (US, EU)} == {US: {2}, EU: {2}}
    assert set(keys_by_epoch(second)[(US, 0)][1]) == old | new
    assert read_region_manifest(replica[US]).generation == 2  # refreshed through the chain by the region's rank
