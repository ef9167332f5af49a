"""Issue 20, part 3: the egress budget holds per job. eu-west-1's bucket is empty and us-east-1's
holds eu-west-1's shards, so every read of an eu-west-1 rank crosses regions. One count per rank,
shared by its DataLoader workers, carried from epoch to epoch and through ``--resume`` (it is part
of the loader state in the checkpoint): past the plan's ``egress.budget`` the loader stops with one
line (exit 1) naming the region pair, the bytes and the budget."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
from guaranteekit import Run, assert_one_line, geoshard
from servers import SeaweedS3
from test_loaders import EU, split

from geoshard.errors import DataError, StorageError
from geoshard.loaders import make_loader

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
