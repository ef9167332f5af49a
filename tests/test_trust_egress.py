"""Issue 20, part 3: the egress budget holds per job. eu-west-1's bucket is empty and us-east-1's
holds eu-west-1's shards, so every read of an eu-west-1 rank crosses regions. One count per rank,
shared by its DataLoader workers, carried from epoch to epoch and through ``--resume`` (it is part
of the loader state in the checkpoint): past the plan's ``egress.budget`` the loader stops with one
line (exit 1) naming the region pair, the bytes and the budget."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from guaranteekit import Run, assert_one_line, geoshard
from servers import SeaweedS3
from test_loaders import EU, split

from geoshard.errors import DataError, StorageError
from geoshard.loaders import make_loader
from geoshard.loaders.chain import ChainSettings, EgressBudgetExceeded, TierChain
from geoshard.loaders.egress import EgressCounter
from geoshard.loaders.local_tier import LocalTier
from geoshard.manifest import ShardEntry

US = "us-east-1"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split(tmp_path_factory.mktemp("corpus"), samples=1500)


def _bucket(server: SeaweedS3, tag: str, folder: Path | None) -> str:
    """A new bucket holding ``folder``'s files under ``train/`` (none: empty); its name."""
    name = f"{tag}-{time.time_ns() % 10**9}"
    server.make_bucket(name)
    if folder is not None:
        with contextlib.closing(server.client()) as c:
            for f in folder.iterdir():
                c.put_object(Bucket=name, Key=f"train/{f.name}", Body=f.read_bytes())
    return name


def _plan(aws: SeaweedS3, corpus: Path, budget: int, out: Path) -> Path:
    """eu-west-1 reads only from us-east-1's bucket, within ``budget`` bytes per rank."""
    split_dir = corpus.parent / "split"
    text = corpus.read_text()
    for region, folder in ((EU, None), (US, split_dir / EU)):
        bucket = _bucket(aws, f"egress-{region[:2]}", folder)
        text = text.replace(f'local = "{split_dir / region}"', f'bucket = "s3://{bucket}/train"\nendpoint = "{aws.endpoint}"')
    plan = out / "plan.toml"
    plan.write_text(f"[egress]\ncross_region = true\nbudget = {budget}\n" + text)
    return plan


def _train(plan: Path, out: Path, steps: int, *extra: object) -> Run:
    args = ("train", "--plan", plan, "--region", EU, "--out", out, "--nproc", "1", "--steps", steps, "--backend", "gloo")
    return geoshard(*args, "--batch-size", 16, "--checkpoint-every", 5, *extra, cwd=out.parent, timeout=300)


def _egress(out: Path) -> int:
    """Bytes the run's ranks read from other regions' buckets, over all its segments (the report's)."""
    r = geoshard("report", out, "--json")
    assert r.rc == 0, r.err[-3000:]
    return sum(json.loads(r.out)["egress_bytes"].values())


def _stop(r: Run, budget: int) -> tuple[int, int]:
    """The one line of a loader stopped at ``budget``: (bytes counted before the read it refused, that read's bytes)."""
    line = assert_one_line(r, StorageError.exit_code, f"from {US}'s bucket into {EU}", f"over the budget of {budget:,} bytes per rank")
    m = re.search(r"\(([\d,]+) bytes\) from .* bring cross-region reads to ([\d,]+) bytes", line)
    assert m, line
    nbytes, total = (int(g.replace(",", "")) for g in m.groups())
    return total - nbytes, nbytes


@pytest.mark.parametrize("workers", [1, 2])
def test_the_loader_stops_at_the_budget_across_workers_and_epochs(aws: SeaweedS3, corpus: Path, tmp_path: Path, workers: int) -> None:
    # An epoch is 25 steps here: the budget lasts about three epochs' reads, the 150 steps are six.
    budget = 4_000_000
    out = tmp_path / "run"
    r = _train(_plan(aws, corpus, budget, tmp_path), out, 150, "--num-workers", workers)
    used, nbytes = _stop(r, budget)
    shard = max(s["bytes"] for s in json.loads((corpus.parent / "split" / EU / "manifest.json").read_text())["shards"])
    assert used <= budget < used + nbytes and nbytes <= shard  # refused the read that would pass it: never over
    steps = len((out / "steps-rank0.jsonl").read_text().splitlines())
    assert 50 < steps < 150  # it ran past two epochs (whose counts the next ones' workers kept), then stopped


def test_resume_carries_the_count_over(aws: SeaweedS3, corpus: Path, tmp_path: Path) -> None:
    budget = 4_000_000
    out = tmp_path / "run"
    plan = _plan(aws, corpus, budget, tmp_path)
    first = _train(plan, out, 60)
    assert first.rc == 0, first.err[-3000:]
    before = _egress(out)
    assert 0 < before <= budget
    # The 50 steps left would read less than the budget on their own: counted on from the
    # checkpoint's count, they stop.
    r = _train(plan, out, 110, "--resume")
    said = [line for line in r.err.splitlines() if "resumed at step 60" not in line]
    used, _ = _stop(dataclasses.replace(r, err="\n".join(said)), budget)
    assert before <= used <= budget


@pytest.mark.parametrize("count", [-1, 1.5, True, "12", 2**63])
def test_a_checkpoints_egress_count_is_checked(corpus: Path, count: object) -> None:
    loader = make_loader(corpus, EU, num_workers=0, batch_size=16)
    state = loader.state_dict()
    assert state["egress_bytes"] == 0
    with pytest.raises(DataError, match="the loader state's egress_bytes"):
        loader.load_state_dict({**state, "egress_bytes": count})
    loader.load_state_dict({**state, "egress_bytes": 123})
    assert loader.state_dict()["egress_bytes"] == 123


def _reserve_until_refused(counter: EgressCounter, budget: int, got: Any) -> None:
    while counter.reserve(10, budget) is not None:
        with got.get_lock():
            got.value += 1


def test_workers_reserving_at_once_never_pass_the_budget() -> None:
    ctx = multiprocessing.get_context("fork")  # as DataLoader's workers start here
    counter, got = EgressCounter(5, ctx), ctx.Value("q", 0)
    procs = [ctx.Process(target=_reserve_until_refused, args=(counter, 10_005, got)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert (counter.used, got.value) == (10_005, 1000)  # every reservation granted is counted once, none past it
    counter.release(10)
    assert counter.used == 9_995


def test_a_cross_region_read_that_fails_gives_its_bytes_back(tmp_path: Path) -> None:
    data = os.urandom(1000)
    entry = ShardEntry("00000-0000-x.tar", 1, len(data), hashlib.sha256(data).hexdigest())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / entry.path).write_bytes(os.urandom(1000))
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / entry.path).write_bytes(data)
    far = [LocalTier(tmp_path / "empty", region="us-east-1"), LocalTier(tmp_path / "bad", region="ap-southeast-1")]
    settings = ChainSettings(egress_budget=1000, writeback=False, verify="sha256")
    chain = TierChain(EU, [*far, LocalTier(tmp_path / "good", region=US)], settings)
    assert bytes(chain.fetch(entry)) == data  # a miss and a corrupt copy before it: their reservations went back
    assert chain.egress.used == 1000 and chain.stats.snapshot().egress_total == 1000
    with pytest.raises(EgressBudgetExceeded, match="would bring cross-region reads to 2,000 bytes, over the budget of 1,000"):
        chain.fetch(entry)
    assert chain.egress.used == 1000
