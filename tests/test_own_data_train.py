"""Your own data, end to end (issue 22, item 5): ``geoshard train`` on a region that was never
synced says so before torchrun starts, with the ``geoshard sync`` that publishes it, instead of a
rank's ``NoSuchBucket`` or ``NoSuchKey`` after the launch. A region the loader can read from its
local replica is not refused. The real command runs in a subprocess against the SeaweedFS
fixture; its whole output and exit code are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from guaranteekit import geoshard
from servers import SeaweedS3
from splitkit import REGIONS, make_corpus
from synckit import sync_plan

from geoshard.errors import ConfigError
from geoshard.plan import load_plan
from geoshard.trainer.published import check_published

US, EU, AP = REGIONS


def test_train_on_regions_never_synced_is_one_line_with_the_sync_that_publishes_them(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "unsynced")
    aws.make_bucket(buckets[EU])  # an empty bucket (NoSuchKey); ap-southeast-1's bucket does not exist (NoSuchBucket)
    run = tmp_path / "run"
    r = geoshard("train", "--plan", plan, "--regions", f"{EU}:1,{AP}:1", "--steps", "2", "--out", run, cwd=tmp_path, timeout=120)
    assert (r.rc, r.out) == (2, ""), r
    assert r.err.splitlines() == [
        f"geoshard: error: regions {EU}, {AP} are not published: no s3://{buckets[EU]}/train/manifest.json, "
        f"s3://{buckets[AP]}/train/manifest.json, and no local replica or Alluxio copy; "
        f"publish with: geoshard sync SPLIT_DIR --plan {plan} --region {EU} --region {AP}"
    ], r.err
    assert not run.exists() and r.seconds < 60  # nothing launched, within the bounded waits

    r = geoshard("train", "--plan", plan, "--region", EU, "--model", "none", "--steps", "2", "--out", run, cwd=tmp_path, timeout=120)
    assert (r.rc, r.out) == (2, ""), r
    assert r.err.splitlines() == [
        f"geoshard: error: region {EU} is not published: no s3://{buckets[EU]}/train/manifest.json, and no local replica or "
        f"Alluxio copy; publish with: geoshard sync SPLIT_DIR --plan {plan} --region {EU}"
    ], r.err
    assert not run.exists()


def test_a_published_region_or_one_with_a_local_replica_passes(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "synced")
    make_corpus(tmp_path / "corpus", samples=200, shard_samples=100)
    split = tmp_path / "split"
    assert geoshard("split", tmp_path / "corpus", "--plan", plan, "--out", split, "--split-workers", "1", cwd=tmp_path).rc == 0
    assert geoshard("sync", split, "--plan", plan, "--region", EU, "--create-buckets", cwd=tmp_path).rc == 0
    check_published(load_plan(plan), [EU], str(plan))
    with pytest.raises(ConfigError, match=f"^region {US} is not published: no s3://{buckets[US]}/train/manifest.json"):
        check_published(load_plan(plan), [EU, US], str(plan))
    # us-east-1's bucket does not exist, but its local replica (a region folder of the split) is what the loader reads first
    plan.write_text(plan.read_text().replace(f"[regions.{US}]\n", f'[regions.{US}]\nlocal = "{split / US}"\n'))
    check_published(load_plan(plan), [EU, US], str(plan))
