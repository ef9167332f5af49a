"""Smaller guarantees (docs/guarantees.md): a failed refresh says why on stderr, a plan cannot
carry credentials into a manifest nor a bucket prefix that climbs, and sync names what differs."""

from __future__ import annotations

import json
from pathlib import Path

from guaranteekit import assert_one_line, geoshard, snapshot
from servers import SeaweedS3
from splitkit import REGIONS, make_corpus, write_plan
from synckit import sync_plan

EU = "eu-west-1"


def test_failed_refresh_names_each_unpublished_region_on_stderr(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "refreshfail")  # buckets never created
    make_corpus(tmp_path / "corpus", samples=200)
    report = tmp_path / "report.json"
    r = geoshard(
        "refresh", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / "out", "--split-workers", "1", "--report", report, cwd=tmp_path
    )
    assert r.rc == 1 and "Traceback" not in r.err
    lines = r.err.strip().splitlines()
    assert sorted(x.split(" not published")[0] for x in lines) == sorted(f"geoshard: error: region {n}" for n in REGIONS), r.err
    assert all("bucket does not exist" in x for x in lines), r.err
    assert json.loads(report.read_text())["ok"] is False


def test_sync_names_a_plan_difference_as_such(tmp_path: Path, aws: SeaweedS3) -> None:
    plan_a, buckets = sync_plan(tmp_path / "a.toml", aws, "planonly")
    for b in buckets.values():
        aws.make_bucket(b)
    plan_b = tmp_path / "b.toml"
    plan_b.write_text(plan_a.read_text().replace("[regions.eu-west-1]\n", '[regions.eu-west-1]\nalluxio = "http://127.0.0.1:9"\n'))
    make_corpus(tmp_path / "corpus", samples=200)
    for name, plan in (("a", plan_a), ("b", plan_b)):
        r = geoshard("split", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / name, "--workers", "1", cwd=tmp_path)
        assert r.rc == 0, r.err
    assert geoshard("sync", tmp_path / "a", "--plan", plan_a, "--region", EU, cwd=tmp_path).rc == 0
    r = geoshard("sync", tmp_path / "b", "--plan", plan_b, "--region", EU, cwd=tmp_path)
    line = assert_one_line(r, 1, f"region {EU} not published", "with the same shards but another plan (plan hash differs)")
    assert "other shards" not in line


def test_plan_endpoint_with_credentials_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    make_corpus(tmp_path / "corpus", samples=50)
    plan = write_plan(tmp_path / "plan.toml")
    plan.write_text(
        plan.read_text().replace("[regions.eu-west-1]\n", '[regions.eu-west-1]\nendpoint = "http://AKIAX:s3cr3t-value@127.0.0.1:9000"\n')
    )
    before = snapshot(tmp_path)
    r = geoshard("split", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / "out", "--workers", "1", cwd=tmp_path)
    line = assert_one_line(r, 2, "regions.eu-west-1.endpoint: must not carry credentials (user:password@)")
    assert "s3cr3t-value" not in r.err + r.out and "s3cr3t" not in line
    assert snapshot(tmp_path) == before


def test_plan_bucket_prefix_that_climbs_is_refused(tmp_path: Path) -> None:
    make_corpus(tmp_path / "corpus", samples=50)
    plan = write_plan(tmp_path / "plan.toml")
    plan.write_text(plan.read_text().replace("[regions.eu-west-1]\n", '[regions.eu-west-1]\nbucket = "s3://bucket-a/../x"\n'))
    r = geoshard("split", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / "out", "--workers", "1", cwd=tmp_path)
    assert_one_line(r, 2, "regions.eu-west-1.bucket: the key prefix must be plain")
    assert not (tmp_path / "out").exists()
