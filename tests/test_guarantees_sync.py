"""Guarantee: ``geoshard sync`` leaves every shard the bucket's manifest names with the manifest's
bytes, repairing an object damaged or overwritten in the bucket (docs/guarantees.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from guaranteekit import geoshard, snapshot
from servers import SeaweedS3
from synckit import make_split, objects, sync_plan

from geoshard.manifest import read_region_manifest
from geoshard.sync.push import ETAG_CACHE
from geoshard.sync.verify_local import S3Etag, etag_of

EU = "eu-west-1"


def _flip_one_byte(server: SeaweedS3, bucket: str, key: str) -> bytes:
    """Overwrite an object with the same bytes but one flipped; returns the original."""
    with contextlib.closing(server.client()) as c:
        body = c.get_object(Bucket=bucket, Key=key)["Body"]
        with body:
            good = body.read()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x01
        c.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    return good


def _sync(out: Path, plan: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    r = geoshard("sync", out, "--plan", plan, "--region", EU, "--json", *extra, cwd=out.parent, timeout=120)
    assert r.rc == 0, r.err
    assert "Traceback" not in r.err
    return json.loads(r.out)["regions"][EU]  # type: ignore[no-any-return]


def test_sync_repairs_a_shard_overwritten_in_the_bucket(tmp_path: Path, aws: SeaweedS3) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "repair")
    aws.make_bucket(buckets[EU])
    out = make_split(tmp_path, plan)
    first = _sync(out, plan)
    shards = read_region_manifest(out / EU).shards
    assert first["uploaded"] == len(shards) >= 2
    victim = shards[1]
    key = f"train/{victim.path}"
    good = _flip_one_byte(aws, buckets[EU], key)
    before = snapshot(tmp_path, skip=out)

    again = _sync(out, plan)
    assert (again["uploaded"], again["repaired"], again["skipped"]) == (1, 1, len(shards) - 1)
    assert objects(aws, buckets[EU])[key] == good
    assert snapshot(tmp_path, skip=out) == before

    # Without the ETag cache (a new checkout of the split folder) the damage is found all the same.
    _flip_one_byte(aws, buckets[EU], key)
    (out / EU / ETAG_CACHE).unlink()
    third = _sync(out, plan)
    assert (third["uploaded"], third["repaired"]) == (1, 1)
    assert objects(aws, buckets[EU])[key] == good
    assert _sync(out, plan)["uploaded"] == 0  # and then it is a no-op again


def test_verify_remote_downloads_and_repairs_what_the_etags_vouch_for(tmp_path: Path, aws: SeaweedS3) -> None:
    """When the ETags cannot be trusted (here: a cache that records the damaged object's ETag),
    --verify-remote still finds the bytes wrong by hashing what the bucket serves."""
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "verifyremote")
    aws.make_bucket(buckets[EU])
    out = make_split(tmp_path, plan)
    _sync(out, plan)
    victim = read_region_manifest(out / EU).shards[0]
    key = f"train/{victim.path}"
    good = _flip_one_byte(aws, buckets[EU], key)
    with contextlib.closing(aws.client()) as c:
        bad_etag = c.head_object(Bucket=buckets[EU], Key=key)["ETag"].strip('"')
    cache = json.loads((out / EU / ETAG_CACHE).read_text())
    cache[victim.sha256] = bad_etag
    (out / EU / ETAG_CACHE).write_text(json.dumps(cache))
    assert _sync(out, plan)["uploaded"] == 0  # the poisoned cache vouches for it
    fixed = _sync(out, plan, "--verify-remote")
    assert (fixed["uploaded"], fixed["repaired"]) == (1, 1)
    assert objects(aws, buckets[EU])[key] == good


def test_local_etag_matches_the_servers_multipart_etag(tmp_path: Path, aws: SeaweedS3) -> None:
    part = 5 * 2**20
    data = os.urandom(2 * part + 1234)
    bucket = "gs-etag-multipart"
    aws.make_bucket(bucket)
    with contextlib.closing(aws.client()) as c:
        up = c.create_multipart_upload(Bucket=bucket, Key="k")
        parts = []
        for i in range(3):
            r = c.upload_part(Bucket=bucket, Key="k", UploadId=up["UploadId"], PartNumber=i + 1, Body=data[i * part : (i + 1) * part])
            parts.append({"PartNumber": i + 1, "ETag": r["ETag"]})
        c.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=up["UploadId"], MultipartUpload={"Parts": parts})
        listed = c.list_objects_v2(Bucket=bucket)["Contents"][0]["ETag"].strip('"')
    e = S3Etag(len(data), part_size=part)
    e.update(data[:7])
    e.update(data[7:])
    assert e.hexdigest() == listed and listed.endswith("-3")
    (tmp_path / "small").write_bytes(data[:1000])
    assert etag_of(tmp_path / "small") == hashlib.md5(data[:1000]).hexdigest()


def test_s5cmd_multipart_upload_lists_the_etag_sync_expects(tmp_path: Path, aws: SeaweedS3) -> None:
    """Objects over s5cmd's part size go up in parts; sync's expected ETag must be the one listed."""
    from geoshard.sync.remote import BucketTarget
    from geoshard.sync.transfer import Transfer, Transferer
    from geoshard.sync.verify_local import PART_SIZE

    bucket = "gs-etag-s5cmd"
    aws.make_bucket(bucket)
    big = tmp_path / "big.tar"
    big.write_bytes(os.urandom(PART_SIZE + 4096))
    target = BucketTarget(EU, bucket, "train", aws.endpoint, None)
    assert Transferer(workers=4).upload([Transfer(str(big), target.url("big.tar"), big.stat().st_size)], target) == {}
    with contextlib.closing(aws.client()) as c:
        listed = c.list_objects_v2(Bucket=bucket)["Contents"][0]["ETag"].strip('"')
    assert listed.endswith("-2") and etag_of(big) == listed
