"""The tier chain's fallback matrix: Alluxio (stand-in worker, real client) → local replica → the
region's bucket → another region's bucket (SeaweedFS), every shard verified by sha256."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from alluxio_standin import AlluxioWorkerStandIn
from servers import SeaweedS3

from geoshard.loaders.chain import AllTiersFailed, ChainSettings, TierChain
from geoshard.loaders.local_tier import LocalTier
from geoshard.loaders.tier import make_tier
from geoshard.manifest import ShardEntry
from geoshard.util.retry import Backoff

FAST = ChainSettings(timeouts=(("alluxio", 0.3), ("s3", 5.0)), backoff=Backoff(attempts=2, base=0.01, jitter=0), cooldown_s=60)


@dataclass
class Rig:
    shards: list[ShardEntry]
    worker: AlluxioWorkerStandIn
    local: LocalTier
    chain: TierChain
    cache_dir: Path
    tiers: list


def _shards(n: int = 4) -> dict[str, bytes]:
    return {f"00000-{i:04d}-x.tar": os.urandom(20_000 + i) for i in range(n)}


@pytest.fixture
def rig(tmp_path: Path, aws: SeaweedS3) -> Iterator[Rig]:
    data = _shards()
    shards = [ShardEntry(p, 1, len(b), hashlib.sha256(b).hexdigest()) for p, b in data.items()]
    tag = f"chain-{time.time_ns() % 10**9}"
    aws.make_bucket(f"{tag}-eu")
    aws.make_bucket(f"{tag}-us")
    with contextlib.closing(aws.client()) as c:
        for p, b in data.items():
            c.put_object(Bucket=f"{tag}-eu", Key=f"train/{p}", Body=b)
            c.put_object(Bucket=f"{tag}-us", Key=f"train/{p}", Body=b)  # a replica in another region
    for d in ("cache", "local"):
        (tmp_path / d).mkdir()
        for p, b in data.items():
            (tmp_path / d / p).write_bytes(b)
    with AlluxioWorkerStandIn(tmp_path / "cache", f"s3://{tag}-eu/train") as worker:
        alluxio = make_tier("alluxio", url=worker.url, ufs_root=f"s3://{tag}-eu/train", region="eu-west-1", timeout_s=0.3)
        local = LocalTier(tmp_path / "local", region="eu-west-1")
        own = make_tier("s3", bucket=f"{tag}-eu", prefix="train", endpoint=aws.endpoint, region="eu-west-1", timeout_s=5)
        far = make_tier("s3", bucket=f"{tag}-us", prefix="train", endpoint=aws.endpoint, region="us-east-1", timeout_s=5)
        tiers = [alluxio, local, own, far]
        yield Rig(shards, worker, local, TierChain("eu-west-1", tiers, FAST), tmp_path / "cache", tiers)
        alluxio.close()  # type: ignore[attr-defined]
        for t in (own, far):
            t.client.close()  # type: ignore[attr-defined]


def _tiers(rig: Rig) -> dict[str, dict]:
    return rig.chain.stats.snapshot().to_dict()["tiers"]


def test_healthy_chain_reads_from_alluxio(rig: Rig) -> None:
    for s in rig.shards:
        assert hashlib.sha256(rig.chain.fetch(s)).hexdigest() == s.sha256
    assert _tiers(rig)["alluxio:eu-west-1"]["hits"] == len(rig.shards)


def test_dead_alluxio_costs_one_failure_not_one_per_shard(rig: Rig) -> None:
    rig.worker.down()
    t = time.monotonic()
    for s in rig.shards:
        rig.chain.fetch(s)
    stats = _tiers(rig)
    assert stats["local:eu-west-1"]["hits"] == len(rig.shards)
    assert stats["alluxio:eu-west-1"]["errors"] == 2  # two attempts of the first shard, then the cooldown
    assert time.monotonic() - t < 5


def test_alluxio_slower_than_its_timeout_falls_back_in_bounded_time(rig: Rig) -> None:
    rig.worker.delay_s = 2.0
    t = time.monotonic()
    rig.chain.fetch(rig.shards[0])
    assert time.monotonic() - t < 1.5  # two 0.3 s timeouts, not the 2 s answer
    assert _tiers(rig)["local:eu-west-1"]["hits"] == 1


def test_corrupt_alluxio_pages_are_caught_and_the_next_tier_serves(rig: Rig) -> None:
    rig.worker.corrupt = True
    assert hashlib.sha256(rig.chain.fetch(rig.shards[1])).hexdigest() == rig.shards[1].sha256
    stats = _tiers(rig)
    assert stats["alluxio:eu-west-1"]["verify_failures"] == 1 and stats["local:eu-west-1"]["hits"] == 1


@pytest.mark.parametrize("damage", ["missing", "corrupted", "truncated"])
def test_bad_local_copy_falls_back_to_s3_and_write_back_repairs_it(rig: Rig, damage: str) -> None:
    rig.worker.down()
    s = rig.shards[2]
    path = rig.local.root / s.path
    if damage == "missing":
        path.unlink()
    elif damage == "corrupted":
        path.write_bytes(b"\0" * s.bytes)
    else:
        path.write_bytes(path.read_bytes()[:100])
    assert hashlib.sha256(rig.chain.fetch(s)).hexdigest() == s.sha256
    stats = _tiers(rig)
    assert stats["s3:eu-west-1"]["hits"] == 1
    assert hashlib.sha256(path.read_bytes()).hexdigest() == s.sha256  # written back, atomically
    rig.chain.fetch(s)
    assert _tiers(rig)["local:eu-west-1"]["hits"] == 1  # the second read is local


def test_missing_in_the_regions_bucket_reads_another_region_as_egress(rig: Rig, aws: SeaweedS3) -> None:
    rig.worker.down()
    s = rig.shards[3]
    (rig.local.root / s.path).unlink()
    own = rig.tiers[2]
    with contextlib.closing(aws.client()) as c:
        c.delete_object(Bucket=own.bucket, Key=f"train/{s.path}")
    assert hashlib.sha256(rig.chain.fetch(s)).hexdigest() == s.sha256
    snap = rig.chain.stats.snapshot().to_dict()
    assert snap["tiers"]["s3:us-east-1"]["hits"] == 1 and snap["egress_bytes"] == {"us-east-1->eu-west-1": s.bytes}
    no_cross = TierChain("eu-west-1", rig.tiers[:3], ChainSettings(allow_cross_region=False, backoff=Backoff(attempts=1)))
    (rig.local.root / s.path).unlink()
    with pytest.raises(AllTiersFailed):
        no_cross.fetch(s)


def test_all_tiers_down_is_one_clear_error_in_bounded_time(rig: Rig) -> None:
    rig.worker.down()
    s = ShardEntry("00000-9999-gone.tar", 1, 10, "0" * 64)
    t = time.monotonic()
    with pytest.raises(AllTiersFailed) as info:
        rig.chain.fetch(s)
    msg = str(info.value)
    assert time.monotonic() - t < 10
    assert "shard 00000-9999-gone.tar (region eu-west-1): no tier could serve it" in msg
    for name in ("alluxio:eu-west-1", "local:eu-west-1", "s3:eu-west-1", "s3:us-east-1"):
        assert name in msg


def test_chain_built_from_the_plan_with_alluxios_s3_proxy(tmp_path: Path, aws: SeaweedS3) -> None:
    """``alluxio = "s3+http://..."``: Alluxio's S3-compatible proxy, here played by SeaweedFS itself."""
    from geoshard.loaders.chain import build_chain
    from geoshard.plan import parse_plan

    data = _shards(2)
    aws.make_bucket("proxy-eu")
    with contextlib.closing(aws.client()) as c:
        for p, b in data.items():
            c.put_object(Bucket="proxy-eu", Key=f"train/{p}", Body=b)
    plan = parse_plan(
        "[egress]\ncross_region = true\n"  # other regions' buckets are opt-in (issue 14)
        f'[regions.eu-west-1]\nweight = 1\nbucket = "s3://proxy-eu/train"\nendpoint = "{aws.endpoint}"\n'
        f'alluxio = "s3+{aws.endpoint}"\nlocal = "{tmp_path / "replica"}"\n'
        f'[regions.us-east-1]\nweight = 1\nbucket = "s3://proxy-us/train"\nendpoint = "{aws.endpoint}"\n'
    )
    chain = build_chain(plan, "eu-west-1")
    assert [t.name for t in chain.tiers] == ["alluxio-s3:eu-west-1", "local:eu-west-1", "s3:eu-west-1", "s3:us-east-1"]
    for p, b in data.items():
        assert chain.fetch(ShardEntry(p, 1, len(b), hashlib.sha256(b).hexdigest())) == b
    assert chain.stats.snapshot().to_dict()["tiers"]["alluxio-s3:eu-west-1"]["hits"] == 2
    assert (tmp_path / "replica" / next(iter(data))).exists()  # written back from the proxy
    assert [t.name for t in build_chain(plan, "eu-west-1", ChainSettings(allow_cross_region=False)).tiers][-1] == "s3:eu-west-1"
