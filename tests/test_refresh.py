"""geoshard refresh, the nightly job: lock, incremental split, sync, report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import SeaweedS3
from splitkit import make_corpus
from synckit import cli, objects, remote_manifest, sync_plan

from geoshard.formats import wds
from geoshard.manifest import read_region_manifest
from geoshard.refresh import LOCK, refresh_lock


def _source(path: Path, prefix: str, n: int, size: int = 300) -> None:
    with open(path, "wb") as f:
        w = wds.TarWriter(f)
        for i in range(n):
            key = f"{prefix}{i:05d}".encode()
            w.write_sample([(key + b".bin", os.urandom(size)), (key + b".cls", b"1")])
        w.close()


def test_second_refresh_exits_75_and_a_dead_holders_lock_is_taken_over(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "lock")
    make_corpus(tmp_path / "c", samples=100)
    out = tmp_path / "out"
    with refresh_lock(out):
        r = cli("refresh", tmp_path / "c", "--plan", plan, "--out", out, "--create-buckets")
        assert r.exit_code == 75 and f"another geoshard refresh (pid {os.getpid()}) is running" in r.stderr
    assert not (out / "manifest.json").exists()
    # A killed holder leaves its pid in the file but no lock: the next run takes over.
    (out / LOCK).write_text("999999\n")
    r = cli("refresh", tmp_path / "c", "--plan", plan, "--out", out, "--create-buckets", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["split"]["generation"] == 1 and (out / LOCK).read_text().strip() != "999999"
    assert all(remote_manifest(aws, b) is not None for b in buckets.values())
    reports = list((out / "reports").glob("refresh-*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["sync"]["regions"]["us-east-1"]["published"]


def test_one_new_source_of_a_hundred_uploads_little_more_than_itself(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "inc", shard_bytes="256KB")
    (tmp_path / "c").mkdir()
    for i in range(100):
        _source(tmp_path / "c" / f"part-{i:03d}.tar", f"p{i:03d}-", 40)
    out = tmp_path / "out"
    first = json.loads(cli("refresh", tmp_path / "c", "--plan", plan, "--out", out, "--create-buckets", "--json").stdout)
    assert first["ok"]
    quiet = json.loads(cli("refresh", tmp_path / "c", "--plan", plan, "--out", out, "--json").stdout)
    assert quiet["split"]["unchanged"] and all(r["uploaded"] == 0 for r in quiet["sync"]["regions"].values())
    _source(tmp_path / "c" / "part-100.tar", "new-", 40)
    new_bytes = (tmp_path / "c" / "part-100.tar").stat().st_size
    doc = json.loads(cli("refresh", tmp_path / "c", "--plan", plan, "--out", out, "--json").stdout)
    uploaded = sum(r["bytes_uploaded"] for r in doc["sync"]["regions"].values())
    objects_up = sum(r["uploaded"] for r in doc["sync"]["regions"].values())
    # The contract: no more than the new data plus one shard per region.
    assert uploaded <= new_bytes + 3 * 256_000, (uploaded, new_bytes)
    assert objects_up <= 3 and len(doc["split"]["groups_run"]) == 1 and doc["split"]["samples_split"] == 40
    print(f"new source {new_bytes} bytes; refresh uploaded {uploaded} bytes in {objects_up} objects")


@pytest.mark.slow
def test_killed_refresh_converges_to_the_uninterrupted_state(tmp_path: Path, aws: SeaweedS3) -> None:
    def setup(name: str) -> tuple[Path, dict[str, str], Path]:
        plan, buckets = sync_plan(tmp_path / f"{name}.toml", aws, name, shard_bytes="64KB")
        corpus = tmp_path / f"{name}-c"
        make_corpus(corpus, samples=6000, sample_bytes=800, shard_samples=500, seed=1)
        return plan, buckets, corpus

    plan, buckets, corpus = setup("ctl")
    assert cli("refresh", corpus, "--plan", plan, "--out", tmp_path / "ctl-out", "--create-buckets").exit_code == 0
    kplan, kbuckets, kcorpus = setup("kil")
    geoshard = str(Path(sys.executable).with_name("geoshard"))
    argv = [geoshard, "refresh", str(kcorpus), "--plan", str(kplan), "--out", str(tmp_path / "kil-out"), "--create-buckets"]
    p = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _count(aws, kbuckets["us-east-1"]) == 0:
        time.sleep(0.05)  # until the sync stage has started on the first region
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert cli("refresh", kcorpus, "--plan", kplan, "--out", tmp_path / "kil-out", "--create-buckets").exit_code == 0
    for region in buckets:
        ctl, kil = objects(aws, buckets[region]), objects(aws, kbuckets[region])
        shards = lambda objs: {k: v for k, v in objs.items() if k.endswith(".tar")}  # noqa: E731
        assert shards(ctl) == shards(kil) and shards(ctl)
        cm, km = json.loads(ctl["train/manifest.json"]), json.loads(kil["train/manifest.json"])
        assert cm["shards"] == km["shards"]
        assert read_region_manifest(tmp_path / "kil-out" / region).shards == read_region_manifest(tmp_path / "ctl-out" / region).shards


def _count(server: SeaweedS3, bucket: str) -> int:
    import contextlib

    with contextlib.closing(server.client()) as c:
        try:
            return int(c.list_objects_v2(Bucket=bucket).get("KeyCount", 0))
        except c.exceptions.NoSuchBucket:
            return 0


def test_sources_are_recorded_by_xxh3_and_a_manifest_with_their_sha256_still_finds_changes(tmp_path: Path, aws: SeaweedS3) -> None:
    """The split records each source's xxh3_128 (no second sha256 pass over the corpus); a top
    manifest written before that (sources by sha256) still tells changed sources from unchanged."""
    import hashlib

    import xxhash
    from guaranteekit import geoshard

    plan, _ = sync_plan(tmp_path / "plan.toml", aws, "srchash", shard_bytes="16KB")
    (tmp_path / "c").mkdir()
    files = [tmp_path / "c" / f"part-{i}.tar" for i in range(4)]
    for i, f in enumerate(files):
        _source(f, f"p{i}-", 30)
    out = tmp_path / "out"

    def run() -> dict:  # type: ignore[type-arg]
        r = geoshard("refresh", tmp_path / "c", "--plan", plan, "--out", out, "--create-buckets", "--json", cwd=tmp_path, timeout=180)
        assert (r.rc, r.err) == (0, ""), r.err
        return json.loads(r.out)["split"]  # type: ignore[no-any-return]

    assert run()["generation"] == 1
    top = json.loads((out / "manifest.json").read_text())
    assert [s["url"] for s in top["sources"]] == [str(f) for f in files]
    for s, f in zip(top["sources"], files, strict=True):
        assert s == {"url": str(f), "size": f.stat().st_size, "xxh3_128": xxhash.xxh3_128(f.read_bytes()).hexdigest(), "group": s["group"]}
    assert len({s["group"] for s in top["sources"]}) == 4  # one group each

    # The manifest as an older geoshard wrote it: sources by sha256.
    for s, f in zip(top["sources"], files, strict=True):
        del s["xxh3_128"]
        s["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(top, indent=1, sort_keys=True) + "\n")
    assert run()["unchanged"]

    # One source changes in place, same size: its group alone runs again.
    data = bytearray(files[2].read_bytes())
    data[600] ^= 0x01  # inside the first sample's payload
    files[2].write_bytes(bytes(data))
    split = run()
    assert (split["generation"], split["groups_run"], split["samples_split"]) == (2, [top["sources"][2]["group"]], 30)
    after = json.loads((out / "manifest.json").read_text())["sources"]
    assert after[:2] + after[3:] == top["sources"][:2] + top["sources"][3:]  # kept as they were, by sha256
    assert after[2] == {"url": str(files[2]), "size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest(), "group": after[2]["group"]}
    assert run()["unchanged"]
