"""Issue 19: the data's life under a long job. Generations visible end to end (a stale replica),
what a job reads stays readable (leases and --delete), resume across a refresh. Real SeaweedFS and
s5cmd; the jobs under torchrun are in test_generations_train.py."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from pathlib import Path

import pytest
from genkit import US, add_source, bucket_of, gen_plan, refresh
from servers import SeaweedS3
from synckit import cli, objects

from geoshard.errors import ConfigError
from geoshard.loaders import ChainSettings, RegionalDataset
from geoshard.loaders.chain import TierChain
from geoshard.loaders.generation import LeaseKeeper
from geoshard.loaders.tier import TierError, TierMissing
from geoshard.manifest import read_region_manifest
from geoshard.manifest.lease import Lease, history_path, lease_path


def _keys(ds: RegionalDataset) -> list[str]:
    return [s["__key__"] for s in ds]


def test_a_replica_one_generation_behind_is_refreshed_through_the_chain_or_named_once(
    aws: SeaweedS3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = gen_plan(tmp_path, aws)
    src, out = tmp_path / "src", tmp_path / "split"
    old = add_source(src, "a", 96)
    assert refresh(src, plan, out)["split"]["generation"] == 1
    replica = tmp_path / "replica" / US
    assert cli("pull", "--plan", plan, "--region", US, "--to", replica).exit_code == 0
    new = add_source(src, "b", 32)
    assert refresh(src, plan, out)["split"]["generation"] == 2
    assert read_region_manifest(replica).generation == 1

    # Write-back off: the loader reads generation 2 (what the replica lacks from the bucket), and says once what is stale.
    with caplog.at_level(logging.WARNING, logger="geoshard.loaders"):
        ds = RegionalDataset(plan, US, shuffle=False, settings=ChainSettings(writeback=False))
        assert sorted(_keys(ds)) == sorted(old | new)
    stale = [r.getMessage() for r in caplog.records if "local replica" in r.getMessage()]
    assert len(stale) == 1, stale
    assert all(w in stale[0] for w in (US, "generation 1", "generation 2", f"geoshard pull --region {US}")), stale[0]
    assert ds.manifest.generation == 2 and read_region_manifest(replica).generation == 1

    # Write-back on (the default): the replica is brought to generation 2, shards first, then its manifest.
    ds = RegionalDataset(plan, US, shuffle=False)
    assert read_region_manifest(replica).generation == 2
    assert all((replica / s.path).stat().st_size == s.bytes for s in ds.manifest.shards)
    assert sorted(_keys(ds)) == sorted(old | new)


def test_sync_delete_keeps_what_a_live_lease_names_and_prunes_an_expired_leases(aws: SeaweedS3, tmp_path: Path) -> None:
    plan = gen_plan(tmp_path, aws, local=False)
    src, out = tmp_path / "src", tmp_path / "split"
    add_source(src, "a", 64)
    refresh(src, plan, out)
    first = read_region_manifest(out / US)
    bucket = bucket_of(plan, US)
    with contextlib.closing(aws.client()) as c:
        c.put_object(Bucket=bucket, Key=f"train/{lease_path('job-a')}", Body=Lease("job-a", US, (1,), time.time() + 600).to_json())
        c.put_object(Bucket=bucket, Key=f"train/{lease_path('job-b')}", Body=Lease("job-b", US, (1,), time.time() - 1).to_json())
    add_source(src, "a", 48)  # the source changed: its group is split again, into shards with new names
    refresh(src, plan, out, "--delete", "--keep-generations", "0")
    held = objects(aws, bucket)
    assert {s.path for s in first.shards} - {s.path for s in read_region_manifest(out / US).shards}
    assert all(f"train/{s.path}" in held for s in first.shards) and f"train/{history_path(1)}" in held
    assert f"train/{lease_path('job-a')}" in held and f"train/{lease_path('job-b')}" not in held  # an expired lease goes
    with contextlib.closing(aws.client()) as c:
        c.delete_object(Bucket=bucket, Key=f"train/{lease_path('job-a')}")
    add_source(src, "a", 40)
    refresh(src, plan, out, "--delete", "--keep-generations", "0")
    held = objects(aws, bucket)
    gone = {s.path for s in first.shards} - {s.path for s in read_region_manifest(out / US).shards}
    assert gone and not any(f"train/{p}" in held for p in gone) and f"train/{history_path(1)}" not in held


def test_resume_after_a_refresh_continues_the_pinned_generation_and_a_deleted_one_is_one_line(
    aws: SeaweedS3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = gen_plan(tmp_path, aws, local=False)
    src, out = tmp_path / "src", tmp_path / "split"
    add_source(src, "a", 96)
    refresh(src, plan, out)
    whole = _keys(RegionalDataset(plan, US, seed=3))
    ds = RegionalDataset(plan, US, seed=3)
    taken = list(itertools.islice(iter(ds), 40))
    state = ds.state_dict()
    assert [s["__key__"] for s in taken] == whole[:40] and state["generation"] == 1
    add_source(src, "b", 32)
    refresh(src, plan, out)

    # Generation 1 is still in the bucket (its history copy): the epoch goes on where it stopped, on it.
    resumed = RegionalDataset(plan, US, seed=3)
    assert resumed.manifest.generation == 2
    resumed.load_state_dict(state)
    assert resumed.manifest.generation == 1 and _keys(resumed) == whole[40:]

    # Pruned (no job held a lease on it): one line saying so and what to do, or, following refreshes, the next epoch.
    add_source(src, "c", 16)
    refresh(src, plan, out, "--delete", "--keep-generations", "0")
    with pytest.raises(ConfigError, match=r"generation 1, which is gone from its bucket; resume with --follow-refresh") as e:
        RegionalDataset(plan, US, seed=3).load_state_dict(state)
    assert "\n" not in str(e.value) and "epoch 1 on generation 3" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="geoshard.loaders"):
        follow = RegionalDataset(plan, US, seed=3, follow_refresh=True)
        follow.load_state_dict(state)
    assert follow.epoch == 1 and follow.manifest.generation == 3 and len(set(_keys(follow))) == 96 + 32 + 16
    assert any("epoch 1 starts on generation 3" in r.getMessage() for r in caplog.records)


class _Bucket:
    """An origin tier that records the leases put to it, or refuses them."""

    kind, region, writable, name = "s3", US, False, f"s3:{US}"

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.puts = refuse, []

    def put(self, path: str, data: bytes) -> None:
        if self.refuse:
            raise TierError(f"{self.name}: AccessDenied")
        self.puts.append((path, Lease.parse(data, path)))

    def stat(self, path: str) -> int | None:
        return None

    def read(self, path: str) -> bytes:
        raise TierMissing(path)

    view = read

    def read_range(self, path: str, offset: int, length: int, progress: object = None) -> bytes:
        raise TierMissing(path)

    def remove_corrupt(self, path: str) -> None:
        pass


def test_a_lease_is_renewed_after_a_quarter_of_its_life_and_a_refused_write_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    bucket = _Bucket()
    keeper = LeaseKeeper(TierChain(US, [bucket], origin=bucket), "job-1", ttl_s=400, clock=lambda: now[0])
    keeper.hold(3, 2)
    assert bucket.puts == [(lease_path("job-1"), Lease("job-1", US, (2, 3), 1400.0))]
    now[0] += 99
    keeper.renew()
    assert len(bucket.puts) == 1
    now[0] += 2
    keeper.renew()
    assert bucket.puts[-1][1].expires == 1501.0 and len(bucket.puts) == 2
    refused = _Bucket(refuse=True)
    keeper = LeaseKeeper(TierChain(US, [refused], origin=refused), "job-1", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="geoshard.loaders"):
        keeper.hold(1)
        keeper.hold(2)
    said = [r.getMessage() for r in caplog.records if "cannot write the lease" in r.getMessage()]
    assert len(said) == 1 and "AccessDenied" in said[0] and "_geoshard/leases/job-1.json" in said[0]
