"""Guarantee: ``geoshard sync`` leaves every shard the bucket's manifest names with the manifest's
bytes, repairing an object damaged or overwritten in the bucket (docs/guarantees.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from guaranteekit import geoshard, snapshot
from servers import SeaweedS3
from synckit import make_split, objects, sync_plan

from geoshard.manifest import MANIFEST, read_region_manifest
from geoshard.sync.etag_cache import ETAG_CACHE
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


def _flip_local(path: Path) -> None:
    """One bit flipped in the middle of a file; its size stays."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_pull_and_verify_catch_a_damaged_shard_by_xxh3_and_by_sha256(tmp_path: Path, aws: SeaweedS3) -> None:
    """``pull`` and ``verify`` check the manifest's xxh3_128 by default and sha256 with
    ``--verify sha256``; a shard damaged in the replica or in the bucket (same size, one bit
    flipped) is caught either way, and a manifest without xxh3_128 is checked by sha256."""
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "pullhash")
    aws.make_bucket(buckets[EU])
    out = make_split(tmp_path, plan)
    _sync(out, plan)
    shards = read_region_manifest(out / EU).shards
    total = sum(s.bytes for s in shards)
    assert len(shards) >= 2 and all(s.xxh3_128 for s in shards)
    for extra, hashed in (((), "xxh3_128"), (("--verify", "sha256"), "sha256")):
        replica = tmp_path / f"replica-{hashed}"
        r = geoshard("pull", "--plan", plan, "--region", EU, "--to", replica, *extra, cwd=tmp_path, timeout=120)
        assert (r.rc, r.err) == (0, ""), r.err
        assert r.out == f"{EU}: {len(shards)} shards fetched ({total:,} bytes), 0 already present, into {replica}; checked by {hashed}\n"
        assert (replica / MANIFEST).read_bytes() == (out / EU / MANIFEST).read_bytes()
        v = geoshard("verify", replica, *extra, "--json", cwd=tmp_path, timeout=60)
        assert (v.rc, v.err, json.loads(v.out)) == (0, "", {"checked": len(shards), "missing": [], "mismatched": [], "hash": hashed})

        # Damage in the replica: verify names the shard, pull fetches that one again.
        victim = replica / shards[1].path
        _flip_local(victim)
        v = geoshard("verify", replica, *extra, cwd=tmp_path, timeout=60)
        assert (v.rc, v.err) == (1, "")
        assert v.out == f"mismatched: {victim}\n{len(shards)} shards checked, 0 missing, 1 mismatched\n"
        r = geoshard("pull", "--plan", plan, "--region", EU, "--to", replica, *extra, "--json", cwd=tmp_path, timeout=120)
        doc = json.loads(r.out)
        assert (r.rc, doc["downloaded"], doc["skipped"], doc["failed"], doc["hash"]) == (0, 1, len(shards) - 1, 0, hashed)
        assert victim.read_bytes() == (out / EU / shards[1].path).read_bytes()

    # Damage in the bucket: no mode accepts it; nothing half-done is left in the replica.
    key = f"train/{shards[0].path}"
    _flip_one_byte(aws, buckets[EU], key)
    for extra in ((), ("--verify", "sha256")):
        replica = tmp_path / f"fresh-{len(extra)}"
        r = geoshard("pull", "--plan", plan, "--region", EU, "--to", replica, *extra, cwd=tmp_path, timeout=120)
        # Two tries more, each logged, then one error line naming the object; exit 1.
        lines = r.err.splitlines()
        assert (r.rc, r.out, len(lines)) == (1, "", 3), r.err
        retry = rf"WARNING geoshard\.sync\.pull: {EU}: 1 download\(s\) failed or did not verify; retrying in \d\.\d s"
        assert all(re.fullmatch(retry, line) for line in lines[:2]), r.err
        assert lines[2] == (
            f"geoshard: error: {EU}: 1 shard(s) could not be fetched and verified, e.g. s3://{buckets[EU]}/{key}; "
            "the replica's manifest was not updated"
        )
        assert sorted(p.name for p in replica.iterdir()) == sorted(s.path for s in shards[1:])

    # A manifest written before xxh3_128 existed: the default check falls back to sha256.
    replica = tmp_path / "replica-xxh3_128"
    doc = json.loads((replica / MANIFEST).read_text())
    for s in doc["shards"]:
        del s["xxh3_128"]
    (replica / MANIFEST).write_text(json.dumps(doc))
    _flip_local(replica / shards[0].path)
    v = geoshard("verify", replica, "--json", cwd=tmp_path, timeout=60)
    want = {"checked": len(shards), "missing": [], "mismatched": [str(replica / shards[0].path)], "hash": "sha256"}
    assert (v.rc, v.err, json.loads(v.out)) == (1, "", want)
