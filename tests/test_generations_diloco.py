"""Issue 23 (d): a nightly refresh (``geoshard refresh``) published while a ``--sync diloco`` job
trains on the peer-to-peer transport (train's default) with ``--follow-refresh``: every region
moves to the new generation at the same epoch boundary, no region loses a round, and report.json's
generations agree. Each region is a torchrun job of its own here, so the generation is not agreed
by the job's all-gather as under flat sync (tests/test_generations_train.py). Keys logged with
--log-keys; the buckets on SeaweedFS."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from genkit import EU, US, add_source, keys_by_epoch, refresh
from killkit import finish_both
from servers import SeaweedS3
from test_generations_train import ADDED, _first_generation, _wait_for_steps

from geoshard.trainer.diloco.auth import Signer
from geoshard.trainer.diloco.generations import PREFIX, RegionGenerations
from geoshard.trainer.diloco.kv import KV, connect_store, host_store

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
H = 5  # outer steps: two rounds an epoch of 10 steps (12 after the refresh)


def _diloco(plan: Path, out: Path, steps: int, sync: str = "diloco", follow: bool = True) -> subprocess.Popen[str]:
    """``geoshard train`` on both regions with the model, --follow-refresh unless ``follow`` is
    False (``sync`` flat: the default gradient sync, one torchrun for the job)."""
    argv = [GEOSHARD, "train", "--plan", str(plan), "--regions", f"{US}:1,{EU}:1", "--out", str(out), "--steps", str(steps)]
    argv += ["--batch-size", "16", "--num-workers", "1", "--backend", "gloo", "--log-keys", "--step-time", "0.25"]
    argv += ["--hidden", "32", "--input-field", "bin", "--label-field", "cls"]
    argv += ["--sync", "diloco", "--outer-steps", str(H)] if sync == "diloco" else []
    argv += ["--follow-refresh"] if follow else []
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out.parent)


def _wait_for_switch_or_epoch(out: Path, region: str, epoch: int, job: subprocess.Popen[str], timeout: float = 180) -> None:
    """Until ``region`` read generation 2, or both regions logged a step of ``epoch`` (whichever first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = keys_by_epoch(out)
        if any(2 in gens for (r, _), (gens, _) in seen.items() if r == region) or {r for r, e in seen if e >= epoch} == {US, EU}:
            return
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"neither a switch in {region} nor epoch {epoch} in {timeout} s")


def _generations(out: Path, old: set[str], new: set[str]) -> dict[int, int]:
    """Per epoch the one generation every region read (the same in both), every complete epoch's
    keys exactly once; the run moved to generation 2 before its last epoch."""
    seen = keys_by_epoch(out)
    epochs = sorted({e for _, e in seen})
    by_epoch = {}
    for e in epochs:
        gens = [seen[(r, e)][0] for r in (US, EU)]
        assert all(len(g) == 1 for g in gens) and gens[0] == gens[1], (e, gens)  # one generation, the same in both regions
        by_epoch[e] = next(iter(gens[0]))
    assert by_epoch[0] == 1 and list(by_epoch.values()) == sorted(by_epoch.values()) and 2 in by_epoch.values(), by_epoch
    assert min(e for e, g in by_epoch.items() if g == 2) < epochs[-1], "the run ended in the switching epoch"
    for r in (US, EU):
        for e in epochs[:-1]:
            counts = seen[(r, e)][1]
            assert set(counts) == (old | new if by_epoch[e] == 2 else old) and max(counts.values()) == 1, (r, e)
    return by_epoch


def _rounds(out: Path, steps: int, by_epoch: dict[int, int]) -> dict[str, Any]:
    """Every round of both regions with both, nothing adopted, missed or lost; the report agrees."""
    for r in (US, EU):
        recs = [json.loads(x) for x in (out / f"rounds-{r}.jsonl").read_text().splitlines()]
        assert [x["event"] for x in recs].count("join") == 1, r
        rounds = [x for x in recs if x["event"] == "round"]
        assert [x["round"] for x in rounds] == list(range(1, steps // H + 1)), r
        for x in rounds:
            assert x["regions"] == [US, EU] and x["missing"] == [] and x["transport"] == "p2p", (r, x)
            assert not x["adopted"] and x["steps_lost"] == 0 and "left_out" not in x, (r, x)
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    assert report["complete"] and report["sync"] == "diloco"
    for r in (US, EU):
        assert {int(e): g for e, g in report["regions"][r]["generations"].items()} == by_epoch, r
        assert report["outer"]["regions"][r] == {"rounds": steps // H, "rounds_missed": 0, "adopted": 0, "joins": 1, "steps_lost": 0}
    return report


@pytest.mark.slow
def test_a_nightly_refresh_during_a_p2p_diloco_run_moves_both_regions_at_one_epoch_boundary(aws: SeaweedS3, tmp_path: Path) -> None:
    plan, src, out, old = _first_generation(tmp_path, aws)
    steps = 70
    job = _diloco(plan, out, steps)
    _wait_for_steps(out, 3, job)
    new = add_source(src, "b", ADDED)
    assert refresh(src, plan, tmp_path / "split")["split"]["generation"] == 2
    stdout, stderr = finish_both(job, out, 400)
    for r in (US, EU):
        line = (
            f"geoshard.trainer: {r}: 1 of the job's 2 rank(s); one rank in the region, no DDP, DiLoCo across {US}:1,{EU}:1 every {H} steps"
        )
        assert line in stdout, stdout[:3000]
    assert "WARNING" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    _rounds(out, steps, _generations(out, old, new))


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["flat", "diloco"])
def test_a_refresh_that_reaches_one_region_first_moves_no_region_before_both_have_it(sync: str, aws: SeaweedS3, tmp_path: Path) -> None:
    """The nightly refresh reaches eu-west-1 first (``refresh --region eu-west-1``) and us-east-1 once
    eu-west-1 read generation 2 or both regions are in epoch 3: no region may move before both
    published generation 2. Flat sync agrees in the job's all-gather; DiLoCo through the outer store."""
    plan, src, out, old = _first_generation(tmp_path, aws)
    steps = 100
    job = _diloco(plan, out, steps, sync)
    _wait_for_steps(out, 3, job)
    new = add_source(src, "b", ADDED)
    refresh(src, plan, tmp_path / "split", "--region", EU)
    _wait_for_switch_or_epoch(out, EU, 3, job)
    refresh(src, plan, tmp_path / "split")
    finish_both(job, out, 400)
    by_epoch = _generations(out, old, new)
    if sync == "diloco":
        _rounds(out, steps, by_epoch)
    report = json.loads((out / "report.json").read_text())
    assert all({int(e): g for e, g in report["regions"][r]["generations"].items()} == by_epoch for r in (US, EU))


@pytest.mark.slow
def test_regions_published_apart_train_on_the_generation_both_have_under_diloco(aws: SeaweedS3, tmp_path: Path) -> None:
    """The pin at start: generation 2 is in eu-west-1's bucket only, so both DiLoCo regions (each its
    own torchrun world) train on generation 1, eu-west-1 from its bucket's history copy."""
    plan, src, out, old = _first_generation(tmp_path, aws)
    add_source(src, "b", ADDED)
    assert refresh(src, plan, tmp_path / "split", "--region", EU)["split"]["generation"] == 2
    steps = 20
    stdout, stderr = finish_both(_diloco(plan, out, steps, follow=False), out, 400)
    assert all(f"geoshard.trainer: {r}: 1 of the job's 2 rank(s)" in stdout for r in (US, EU)), stdout[:3000]
    assert "WARNING" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    seen = keys_by_epoch(out)
    assert {e for _, e in seen} == {0, 1}, sorted(seen)
    for (r, e), (gens, counts) in seen.items():
        assert gens == {1} and set(counts) == old and max(counts.values()) == 1, (r, e, gens)
    _rounds(out, steps, {0: 1, 1: 1})


# The agreement itself, two regions' leaders on one real TCPStore (no torchrun): fast.
SECRET = b"s" * 32


def _leaders(timeout_s: float = 10.0) -> tuple[Any, RegionGenerations, RegionGenerations]:
    """The job's store (held by the caller) and each region leader's own connection to it."""
    store = host_store(timeout_s=10.0)
    kvs = [KV(connect_store("127.0.0.1", store.port, 10.0), PREFIX, Signer(SECRET)) for _ in (US, EU)]
    us, eu = (RegionGenerations(r, (US, EU), kv=kv, start_timeout_s=timeout_s) for r, kv in zip((US, EU), kvs, strict=True))
    return store, us, eu


def _pin_both(us: RegionGenerations, eu: RegionGenerations, newest: dict[str, int | None]) -> dict[str, int | None]:
    """Both leaders pin at once (each waits for the other's first report), in two threads."""
    pinned: dict[str, int | None] = {}
    threads = [threading.Thread(target=lambda g=g: pinned.__setitem__(g.region, g(newest[g.region], None))) for g in (us, eu)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return pinned


def test_the_pin_at_start_is_the_least_generation_the_regions_published() -> None:
    _store, us, eu = _leaders()
    began = time.monotonic()
    assert _pin_both(us, eu, {US: 1, EU: 2}) == {US: 1, EU: 1}
    assert time.monotonic() - began < 5  # not the bound: both reported
    _store, us, eu = _leaders()
    assert _pin_both(us, eu, {US: 3, EU: None}) == {US: 3, EU: 3}  # a region without a bucket has no say


def test_a_generation_one_region_has_moves_no_region_and_both_move_at_one_announced_epoch() -> None:
    _store, us, eu = _leaders()
    _pin_both(us, eu, {US: 1, EU: 1})
    assert eu(2, 3) == 1 and us(1, 3) == 1 and eu(2, 4) == 1  # only eu-west-1 has 2: nobody moves
    assert us(2, 4) == 1  # us-east-1 has it now: it announces epoch 5 for both, and epoch 4 stays on 1
    assert eu(2, 4) == 1  # eu-west-1 decides epoch 4 again (late): still 1
    assert eu(2, 5) == 2 and us(2, 5) == 2
    assert us(1, 6) == 2 and us.reported == 2  # a bucket read older later takes nothing back


def test_a_report_not_signed_by_the_job_counts_as_missing_and_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    _store, us, eu = _leaders()
    _pin_both(us, eu, {US: 1, EU: 1})
    forged = KV(_store, PREFIX, Signer(b"x" * 32))
    for _ in range(2):
        forged.set(forged.key("report", EU), "9")
        assert us(9, 2) == 1 and us(9, 3) == 1
    us.kv.set(us.kv.key("report", EU), "zero")  # signed, but not a generation
    assert us(9, 4) == 1
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 2 and all(f"{PREFIX}/report/{EU}" in m for m in refused), refused
    assert "unauthenticated" in refused[0] and "malformed" in refused[1]
    us.kv.set(us.kv.key("report", EU), "9")
    assert us(9, 5) == 1 and us(9, 6) == 9  # a good report again: announced for epoch 6


def test_a_region_silent_at_start_is_waited_for_with_a_bound_and_named(caplog: pytest.LogCaptureFixture) -> None:
    _store, us, _ = _leaders(timeout_s=0.3)
    began = time.monotonic()
    assert us(2, None) == 2
    assert time.monotonic() - began < 5
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and f"{EU} said nothing within 0.3 s" in said[0], said
    assert us(2, 1) == 2  # no move, no announcement while eu-west-1 is silent


def test_a_region_more_than_an_epoch_ahead_of_the_announcement_moves_at_its_next_decision_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _store, us, eu = _leaders()
    _pin_both(us, eu, {US: 1, EU: 1})
    assert us(2, 5) == 1  # us-east-1 runs ahead; eu-west-1 has not reported generation 2 yet
    assert eu(2, 3) == 1  # now both have it: announced from epoch 4, which us-east-1 decided already
    assert eu(2, 4) == 2 and us(2, 6) == 2 and us(2, 7) == 2
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and f"region {US} reads generation 2 from epoch 6; the job announced it from epoch 4" in said[0], said


def test_a_restarted_leader_never_reports_lower_than_its_region_did() -> None:
    _store, us, eu = _leaders()
    _pin_both(us, eu, {US: 2, EU: 2})
    again = RegionGenerations(US, (US, EU), kv=KV(connect_store("127.0.0.1", _store.port, 10.0), PREFIX, Signer(SECRET)))
    assert again(1, None) == 2 and again.reported == 2  # its bucket read older (a stale endpoint): the report stays
