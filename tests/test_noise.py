"""Noise in a run's output (issue 22, item 11): a dead tier is logged once per process, and not
again by a process that inherited its cooldown from the one that logged it (the next epoch's
DataLoader workers); the stats still count every failure."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from tierkit import dead_alluxio, replica_beside_dead_alluxio

from geoshard.loaders.chain import ChainSettings, TierChain
from geoshard.util.retry import Backoff

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))


def test_a_dead_tier_is_not_logged_again_by_a_process_that_inherited_its_cooldown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data, shards, local, port = replica_beside_dead_alluxio(tmp_path, 3)
    settings = ChainSettings(backoff=Backoff(attempts=1, base=0.01, jitter=0), cooldown_s=30)
    now = [1000.0]

    def chain() -> TierChain:
        return TierChain("eu-west-1", [dead_alluxio(port), local], settings, clock=lambda: now[0])

    first, second = chain(), chain()  # two epochs' workers of one rank
    with caplog.at_level(logging.DEBUG, logger="geoshard"):
        assert bytes(first.fetch(shards[0])) == data[shards[0].path]
        second.note_cooldowns(first.cooldowns())  # through the parent, as the loader passes it on
        now[0] += 31  # the cooldown is over: the second worker tries the dead tier again
        for s in shards:
            assert bytes(second.fetch(s)) == data[s.path]
    failed = [r for r in caplog.records if "alluxio:eu-west-1 failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.WARNING, logging.DEBUG]
    assert failed[0].getMessage().endswith("; its later failures are counted in the report's tiers table, not logged again by this process")
    assert second.stats.snapshot().to_dict()["tiers"]["alluxio:eu-west-1"]["errors"] == 1


LOADER_JOB = """
import logging, sys
from geoshard.loaders import ChainSettings, make_loader
from geoshard.util.retry import Backoff
logging.basicConfig(level=logging.WARNING, format="%(processName)s %(message)s")
# No cooldown: every worker tries the dead Alluxio for every shard, as after each cooldown of a long run.
settings = ChainSettings(cooldown_s=0, backoff=Backoff(attempts=1, base=0.01, jitter=0))
loader = make_loader(sys.argv[1], "eu-west-1", batch_size=16, num_workers=2, seed=0, settings=settings)
for epoch in range(2):
    loader.set_epoch(epoch)
    n = sum(len(b["__key__"]) for b in loader)
print("samples", n)
"""


def test_a_dead_alluxio_is_one_line_for_a_loaders_workers_and_epochs(tmp_path: Path) -> None:
    """The demo's case: a rank's two DataLoader workers over two epochs meet a dead Alluxio; the
    rank's process logs it once (its workers hand their first failure to it; before, each worker
    of each epoch logged it: 4 lines here), the replica serves."""
    from splitkit import make_corpus

    from geoshard.local.ports import closed_port

    make_corpus(tmp_path / "corpus", samples=800, sample_bytes=300, shard_samples=100)
    plan = tmp_path / "plan.toml"
    plan.write_text('[shards]\nbytes = "20KB"\n[regions.eu-west-1]\nweight = 1\n')
    split = subprocess.run(
        [GEOSHARD, "split", str(tmp_path / "corpus"), "--plan", str(plan), "--out", str(tmp_path / "split")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert split.returncode == 0, split.stderr
    alluxio = f"http://127.0.0.1:{closed_port()}"
    local = tmp_path / "split" / "eu-west-1"
    plan.write_text(
        f'[shards]\nbytes = "20KB"\n[regions.eu-west-1]\nweight = 1\nbucket = "s3://nowhere/train"\n'
        f'alluxio = "{alluxio}"\nlocal = "{local}"\n'
    )
    r = subprocess.run([sys.executable, "-c", LOADER_JOB, str(plan)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["samples", "800"], r.stdout
    failed = [line for line in r.stderr.splitlines() if "alluxio:eu-west-1 failed" in line]
    assert len(failed) == 1 and failed[0].startswith("MainProcess "), r.stderr[-3000:]
    assert "counted in the report's tiers table" in failed[0]
