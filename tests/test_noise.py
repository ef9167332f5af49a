"""Noise in a run's output (issue 22, item 11): a dead tier is logged once per process, and not
again by a process that inherited its cooldown from the one that logged it (the next epoch's
DataLoader workers); the stats still count every failure."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from geoshard.loaders.chain import ChainSettings, TierChain
from geoshard.loaders.local_tier import LocalTier
from geoshard.loaders.tier import make_tier
from geoshard.local.ports import free_ports
from geoshard.manifest import ShardEntry
from geoshard.util.retry import Backoff


def test_a_dead_tier_is_not_logged_again_by_a_process_that_inherited_its_cooldown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (port,) = free_ports(1)  # nothing listens there, as in the demo
    data = {f"00000-{i:04d}-x.tar": os.urandom(1000 + i) for i in range(3)}
    (tmp_path / "local").mkdir()
    for p, b in data.items():
        (tmp_path / "local" / p).write_bytes(b)
    shards = [ShardEntry(p, 1, len(b), hashlib.sha256(b).hexdigest()) for p, b in data.items()]
    settings = ChainSettings(backoff=Backoff(attempts=1, base=0.01, jitter=0), cooldown_s=30)
    now = [1000.0]

    def chain() -> TierChain:
        alluxio = make_tier("alluxio", url=f"http://127.0.0.1:{port}", ufs_root="s3://b/train", region="eu-west-1", timeout_s=0.3)
        return TierChain("eu-west-1", [alluxio, LocalTier(tmp_path / "local", region="eu-west-1")], settings, clock=lambda: now[0])

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
    assert second.stats.snapshot()["tiers"]["alluxio:eu-west-1"]["errors"] == 1
