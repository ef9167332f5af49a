"""Noise in a run's output (issue 22, item 11): a dead tier is logged once per process, and not
again by a process that inherited its cooldown from the one that logged it (the next epoch's
DataLoader workers); the stats still count every failure."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tierkit import dead_alluxio, replica_beside_dead_alluxio

from geoshard.loaders.chain import ChainSettings, TierChain
from geoshard.util.retry import Backoff


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
