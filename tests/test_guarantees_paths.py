"""Guarantees about files geoshard does not own (docs/guarantees.md): a manifest cannot make pull
write outside --to, nor verify read outside its folder, nor the loader delete a user's files."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest
from guaranteekit import assert_one_line, geoshard, snapshot
from servers import SeaweedS3
from synckit import sync_plan

from geoshard.errors import ConfigError
from geoshard.manifest import RegionManifest, ShardEntry
from geoshard.util.paths import check_shard_path, is_shard_name

EU = "eu-west-1"
GOOD = "00000-0000-0123456789ab.tar"


@pytest.mark.parametrize(
    "path", [".", "..", "../x.tar", "a//b.tar", "/etc/x.tar", "a/./b.tar", "", "x\\..\\y.tar", "notes.txt", "docs/report.pdf"]
)
def test_the_one_path_check_refuses_what_is_not_a_shard_name(path: str) -> None:
    with pytest.raises(ConfigError, match=r"m\.json: "):
        check_shard_path(path, "m.json")


def test_the_one_path_check_accepts_shard_names() -> None:
    assert check_shard_path(GOOD, "m") == GOOD and is_shard_name("00012-0003-abcdefabcdef.tfrecord")
    assert not is_shard_name("00000-0000-0123456789ab.tar.partial")


def _manifest(paths: list[str], data: bytes = b"x" * 1000) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    shards = tuple(ShardEntry(p, 1, len(data), sha) for p in paths)
    return RegionManifest(region=EU, format="wds", generation=1, plan_sha256="0" * 64, shards=shards).to_json()


# 4. pull never writes outside --to ---------------------------------------------------------------


@pytest.mark.parametrize("path", [".", "../evil.tar", "sub/../../evil.tar"])
def test_pull_refuses_a_manifest_path_outside_to(tmp_path: Path, aws: SeaweedS3, path: str) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "pathpull")
    aws.make_bucket(buckets[EU])
    bucket = buckets[EU]
    payload = b"chosen by the manifest's author" * 20000
    with contextlib.closing(aws.client()) as c:
        c.put_object(Bucket=bucket, Key="train/manifest.json", Body=_manifest([path], payload))
        with contextlib.suppress(Exception):  # SeaweedFS refuses some of these keys; the check must not need them
            c.put_object(Bucket=bucket, Key=f"train/{path}", Body=payload)
    to = tmp_path / "work" / "replica"
    to.parent.mkdir()
    before = snapshot(tmp_path)
    r = geoshard("pull", "--plan", plan, "--region", EU, "--to", to, cwd=tmp_path, timeout=60)
    assert_one_line(r, 2, "manifest.json: shard path", repr(path), "is not a plain relative file name")
    assert snapshot(tmp_path) == before  # not even --to was created
    assert not to.exists()


def test_pull_refuses_a_non_shard_name(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "pathpull")
    aws.make_bucket(buckets[EU])
    bucket = buckets[EU]
    with contextlib.closing(aws.client()) as c:
        c.put_object(Bucket=bucket, Key="train/manifest.json", Body=_manifest(["notes.txt"]))
        c.put_object(Bucket=bucket, Key="train/notes.txt", Body=b"x" * 1000)
    to = tmp_path / "replica"
    to.mkdir()
    (to / "notes.txt").write_text("the user's own notes\n")
    before = snapshot(tmp_path)
    r = geoshard("pull", "--plan", plan, "--region", EU, "--to", to, cwd=tmp_path, timeout=60)
    assert_one_line(r, 2, "'notes.txt' is not a shard name")
    assert snapshot(tmp_path) == before


# verify reads only inside its folder --------------------------------------------------------------


def test_verify_refuses_a_manifest_path_outside_the_split(tmp_path: Path) -> None:
    out = tmp_path / "split"
    (out / EU).mkdir(parents=True)
    (tmp_path / "secret.tar").write_bytes(b"s" * 1000)
    (out / EU / "manifest.json").write_bytes(_manifest(["../../secret.tar"]))
    top = {
        "generation": 1,
        "created": "2026-01-01T00:00:00+00:00",
        "format": "wds",
        "plan": {},
        "plan_sha256": "0" * 64,
        "layout_sha256": "0" * 64,
        "regions": {EU: {"manifest": f"{EU}/manifest.json", "shards": 1, "samples": 1, "bytes": 1000, "sha256": "0" * 64}},
        "sources": [],
    }
    (out / "manifest.json").write_text(json.dumps(top))
    r = geoshard("verify", out, cwd=tmp_path, timeout=60)
    assert_one_line(r, 2, "'../../secret.tar' is not a plain relative file name")


# 3. The loader never deletes a file it did not write ------------------------------------------------


def test_loader_refuses_a_manifest_naming_the_users_files_and_deletes_nothing(tmp_path: Path) -> None:
    from geoshard.loaders import make_loader

    local = tmp_path / "replica"
    (local / "docs").mkdir(parents=True)
    (local / "notes.txt").write_text("my notes\n")
    (local / "docs" / "report.pdf").write_bytes(b"%PDF-1.4 my report")
    (local / "manifest.json").write_bytes(_manifest(["notes.txt", "docs/report.pdf"]))  # sha256 of neither: "corrupt"
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[regions.{EU}]\nweight = 1\nlocal = "{local}"\n')
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"'notes.txt' is not a shard name"):
        for _ in make_loader(plan, region=EU, num_workers=0, batch_size=1):
            pass
    # Reading the manifest refreshes its recency (mtime); nothing is created, removed or changed.
    assert {k: v[0] for k, v in snapshot(tmp_path).items()} == {k: v[0] for k, v in before.items()}
    assert (local / "notes.txt").read_text() == "my notes\n" and (local / "docs" / "report.pdf").read_bytes() == b"%PDF-1.4 my report"


def test_local_tier_removes_only_shard_names(tmp_path: Path) -> None:
    from geoshard.loaders.local_tier import LocalTier

    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / GOOD).write_bytes(b"corrupt copy")
    tier = LocalTier(tmp_path, region=EU)
    tier.remove("notes.txt")
    tier.remove(GOOD)
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / GOOD).exists()
