"""Guarantee: an endpoint that accepts TCP and never answers costs a bounded time (docs/guarantees.md).

Commands fail within 2 x GEOSHARD_TIMEOUT per request (two tries of a connect-and-read bound),
with regions checked in parallel; the loader fails over to the next tier within
``backoff.attempts x`` its tier timeout."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from guaranteekit import BlackHole, geoshard, snapshot
from servers import SeaweedS3
from splitkit import REGIONS, make_corpus
from synckit import make_split, sync_plan

from geoshard.loaders.chain import ChainSettings, build_chain
from geoshard.manifest import read_region_manifest
from geoshard.plan import load_plan
from geoshard.util.retry import Backoff

EU = "eu-west-1"
T = 2.0  # GEOSHARD_TIMEOUT in these tests
STARTUP = 8.0  # the command's own start (Python, boto3, click) on a loaded 2-core machine


@pytest.fixture
def hole() -> Iterator[BlackHole]:
    with BlackHole() as h:
        yield h


def _all_regions_at(plan: Path, url: str) -> None:
    text = plan.read_text()
    for line in [x for x in text.splitlines() if x.startswith("endpoint = ")]:
        text = text.replace(line, f'endpoint = "{url}"')
    plan.write_text(text)


def _stderr_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return err.strip().splitlines()


def test_sync_of_three_hanging_regions_fails_in_parallel_within_the_bound(tmp_path: Path, aws: SeaweedS3, hole: BlackHole) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "hang")
    out = make_split(tmp_path, plan, samples=200)
    _all_regions_at(plan, hole.url)
    before = snapshot(tmp_path, skip=out)
    r = geoshard("sync", out, "--plan", plan, cwd=tmp_path, env={"GEOSHARD_TIMEOUT": str(T)}, timeout=120)
    assert r.rc == 1
    lines = _stderr_lines(r.err)
    assert len(lines) == 3, r.err
    for region, line in zip(sorted(REGIONS), sorted(lines), strict=True):
        assert line.startswith(f"geoshard: error: region {region} not published: s3://") and "cannot reach the endpoint" in line, line
    # Sequentially it would take 3 regions x 2 tries x T; in parallel 2 x T.
    assert r.seconds < 2 * T + STARTUP < 3 * 2 * T + 2, r.seconds
    assert snapshot(tmp_path, skip=out) == before


def test_probe_of_three_hanging_regions_fails_in_parallel_within_the_bound(tmp_path: Path, aws: SeaweedS3, hole: BlackHole) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "hangprobe")
    _all_regions_at(plan, hole.url)
    t = 4.0  # long enough that three regions one after the other could not fit the bound
    r = geoshard("probe", "--plan", plan, "--png", tmp_path / "p.png", cwd=tmp_path, env={"GEOSHARD_TIMEOUT": str(t)}, timeout=120)
    assert r.rc == 1
    lines = _stderr_lines(r.err)
    assert len(lines) == 3 and all(x.startswith("geoshard: error: region ") and "ReadTimeoutError" in x for x in lines), r.err
    assert r.seconds < 2 * t + STARTUP < 3 * 2 * t, r.seconds


def test_pull_from_a_hanging_endpoint_fails_within_the_default_bound(tmp_path: Path, aws: SeaweedS3, hole: BlackHole) -> None:
    """No GEOSHARD_TIMEOUT: the default (10 s a request, two tries) still means seconds, not minutes."""
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "hangpull")
    _all_regions_at(plan, hole.url)
    before = snapshot(tmp_path)
    r = geoshard("pull", "--plan", plan, "--region", EU, "--to", tmp_path / "replica", cwd=tmp_path, timeout=120)
    lines = _stderr_lines(r.err)
    assert r.rc == 1 and len(lines) == 1 and "GET manifest.json failed: cannot reach the endpoint" in lines[0], r.err
    assert r.seconds < 2 * 10 + STARTUP, r.seconds
    assert snapshot(tmp_path) == before


def test_split_of_s3_sources_at_a_hanging_endpoint_fails_within_the_bound(tmp_path: Path, aws: SeaweedS3, hole: BlackHole) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text("[regions.eu-west-1]\nweight = 1\n")
    r = geoshard(
        "split",
        "s3://corpus/train/",
        "--plan",
        plan,
        "--out",
        tmp_path / "out",
        "--endpoint",
        hole.url,
        "--workers",
        "1",
        cwd=tmp_path,
        env={"GEOSHARD_TIMEOUT": str(T)},
        timeout=120,
    )
    lines = _stderr_lines(r.err)
    assert r.rc == 1 and len(lines) == 1 and "s3://corpus/train/: cannot reach S3 at" in lines[0], r.err
    assert r.seconds < 2 * T + STARTUP, r.seconds
    assert not (tmp_path / "out").exists()


def test_bad_timeout_setting_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text('[regions.eu-west-1]\nweight = 1\nbucket = "s3://bucket-x/x"\n')
    r = geoshard("pull", "--plan", tmp_path / "p.toml", "--region", EU, "--to", tmp_path / "r", env={"GEOSHARD_TIMEOUT": "soon"})
    assert r.rc == 2 and r.err.strip() == "geoshard: error: GEOSHARD_TIMEOUT: must be a number of seconds > 0, got 'soon'", r.err


def test_loader_fails_over_from_a_hanging_bucket_within_the_bound(tmp_path: Path, aws: SeaweedS3, hole: BlackHole) -> None:
    """eu-west-1's own bucket hangs; another region's bucket holds a copy: every shard is served
    from it, and the hang costs at most backoff.attempts x the tier timeout, once (then a cooldown)."""
    make_corpus(tmp_path / "corpus", samples=600, shard_samples=100)
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "failover")
    for b in buckets.values():
        aws.make_bucket(b)
    out = make_split(tmp_path, plan)
    shards = read_region_manifest(out / EU).shards
    with contextlib.closing(aws.client()) as c:  # a copy of eu-west-1 in us-east-1's bucket
        for f in (out / EU).iterdir():
            if not f.name.startswith("."):
                c.put_object(Bucket=buckets["us-east-1"], Key=f"train/{f.name}", Body=f.read_bytes())
    text = plan.read_text().replace(
        f'bucket = "s3://{buckets[EU]}/train"\nendpoint = "{aws.endpoint}"', f'bucket = "s3://{buckets[EU]}/train"\nendpoint = "{hole.url}"'
    )
    plan.write_text(text)
    attempts, timeout = 2, T
    settings = ChainSettings(
        timeouts=(("s3", timeout),),
        backoff=Backoff(attempts=attempts, base=0.1, cap=0.2, jitter=0),
        writeback=False,
        allow_cross_region=True,
    )
    chain = build_chain(load_plan(plan), EU, settings)
    t0 = time.monotonic()
    manifest = chain.read_manifest()
    assert [s.path for s in manifest.shards] == [s.path for s in shards]
    for s in manifest.shards:
        assert len(chain.fetch(s)) == s.bytes
    elapsed = time.monotonic() - t0
    tiers = chain.stats.snapshot().to_dict()["tiers"]
    assert tiers[f"s3:{EU}"]["errors"] >= 1 and tiers["s3:us-east-1"]["hits"] == len(shards)
    assert elapsed < attempts * (timeout + 0.2) + 3.0, elapsed
