"""The fast hash of record: xxh3-128 beside sha256 in region manifests, written by the real split,
checked by reads by default (sha256 on request or where a manifest predates it), and used by
sync's pre-upload check in the same pass as the MD5 it needs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from splitkit import make_corpus, write_plan

from geoshard.errors import ConfigError, DataError
from geoshard.loaders.chain import AllTiersFailed, ChainSettings, TierChain
from geoshard.loaders.local_tier import LocalTier
from geoshard.manifest import RegionManifest, ShardEntry, parse_region_manifest, read_region_manifest
from geoshard.sync.verify_local import check_local
from geoshard.util import hashing

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))


def test_digests_match_the_reference_implementations() -> None:
    data = os.urandom(3 * (1 << 20) + 12345)  # several 1 MB pieces and a tail
    h = hashing.MultiHasher(("sha256", "xxh3_128", "md5"))
    for i in range(0, len(data), 700_001):  # uneven feeding: pieces above and below 1 MB
        h.update(memoryview(data)[i : i + 700_001] if i % 2 else data[i : i + 700_001])
    assert h.hexdigests() == {
        "sha256": hashlib.sha256(data).hexdigest(),
        "xxh3_128": xxhash.xxh3_128(data).hexdigest(),
        "md5": hashlib.md5(data).hexdigest(),
    }
    assert hashing.xxh3_128(b"") == "99aa06d3014798d86001c324468d497f"  # XXH3_128bits of nothing (xxHash's test vector)
    with pytest.raises(ValueError, match="unknown hash 'crc'"):
        hashing.new("crc")


def test_file_digests_in_one_pass(tmp_path: Path) -> None:
    data = os.urandom(9 << 20)
    (tmp_path / "f").write_bytes(data)
    digests, n = hashing.file_digests(tmp_path / "f", "xxh3_128", "md5")
    assert n == len(data)
    assert digests == {"xxh3_128": xxhash.xxh3_128(data).hexdigest(), "md5": hashlib.md5(data).hexdigest()}


def test_manifest_without_the_fast_hash_still_reads_and_writes_back_unchanged() -> None:
    old = {
        "version": 1,
        "region": "eu-west-1",
        "format": "wds",
        "generation": 2,
        "plan_sha256": "p",
        "samples": 3,
        "bytes": 2048,
        "shards": [{"path": "00000-0000-aaaaaaaaaaaa.tar", "samples": 3, "bytes": 2048, "sha256": "a" * 64, "group": 0}],
    }
    rm = parse_region_manifest(json.dumps(old).encode(), "old.json")
    assert rm.shards[0].xxh3_128 == ""
    assert json.loads(rm.to_json()) == old  # no empty field appears
    new = RegionManifest("eu-west-1", "wds", 2, "p", (ShardEntry("x.tar", 3, 2048, "a" * 64, 0, "b" * 32),))
    again = parse_region_manifest(new.to_json(), "new.json")
    assert again.shards[0].xxh3_128 == "b" * 32 and json.loads(new.to_json())["shards"][0]["xxh3_128"] == "b" * 32


def test_split_records_both_digests_of_every_shard(tmp_path: Path) -> None:
    make_corpus(tmp_path / "c", samples=600)
    plan = write_plan(tmp_path / "plan.toml")
    r = subprocess.run(
        [GEOSHARD, "split", str(tmp_path / "c"), "--plan", str(plan), "--out", str(tmp_path / "out"), "--workers", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples_in"] == 600
    checked = 0
    for region in ("us-east-1", "eu-west-1", "ap-southeast-1"):
        for s in read_region_manifest(tmp_path / "out" / region).shards:
            data = (tmp_path / "out" / region / s.path).read_bytes()
            assert s.sha256 == hashlib.sha256(data).hexdigest()
            assert s.xxh3_128 == xxhash.xxh3_128(data).hexdigest()
            checked += 1
    assert checked >= 3


def _chain(tmp_path: Path, verify: str) -> TierChain:
    return TierChain("eu-west-1", [LocalTier(tmp_path, region="eu-west-1")], ChainSettings(verify=verify, writeback=False))


@pytest.mark.parametrize(
    ("verify", "xxh3_ok", "sha_ok", "served"),
    [
        ("xxh3", True, False, True),  # the default checks the fast hash only
        ("xxh3", False, True, False),
        ("sha256", True, False, False),  # sha256 on request
        ("sha256", False, True, True),
        ("size", False, False, True),
    ],
)
def test_reads_verify_the_fast_hash_by_default(tmp_path: Path, verify: str, xxh3_ok: bool, sha_ok: bool, served: bool) -> None:
    data = os.urandom(50_000)
    (tmp_path / "00000-0000-000000000000.tar").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest() if sha_ok else "0" * 64
    fast = xxhash.xxh3_128(data).hexdigest() if xxh3_ok else "0" * 32
    chain = _chain(tmp_path, verify)
    if served:
        assert bytes(chain.fetch(ShardEntry("00000-0000-000000000000.tar", 1, len(data), sha, 0, fast))) == data
    else:
        with pytest.raises(AllTiersFailed, match=r"00000-0000-000000000000\.tar does not match its manifest"):
            chain.fetch(ShardEntry("00000-0000-000000000000.tar", 1, len(data), sha, 0, fast))
        assert chain.stats.snapshot().to_dict()["tiers"]["local:eu-west-1"]["verify_failures"] == 1
        assert not (tmp_path / "00000-0000-000000000000.tar").exists()  # a corrupt local copy (a shard name) is removed


def test_manifest_without_the_fast_hash_is_checked_with_sha256(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    (tmp_path / "s.tar").write_bytes(data)
    good = ShardEntry("s.tar", 1, len(data), hashlib.sha256(data).hexdigest())
    assert bytes(_chain(tmp_path, "xxh3").fetch(good)) == data
    with pytest.raises(AllTiersFailed, match="does not match"):
        _chain(tmp_path, "xxh3").fetch(ShardEntry("s.tar", 1, len(data), "1" * 64))


def test_verify_setting_is_validated() -> None:
    assert ChainSettings().verify == "xxh3"
    with pytest.raises(ConfigError, match="verify must be 'xxh3', 'sha256' or 'size', got 'md5'"):
        ChainSettings(verify="md5")


def test_sync_check_uses_the_fast_hash_and_returns_md5_from_the_same_pass(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    p = tmp_path / "s.tar"
    p.write_bytes(data)
    entry = ShardEntry("s.tar", 1, len(data), "not-checked", 0, xxhash.xxh3_128(data).hexdigest())
    assert check_local(entry, p, "eu-west-1", md5=True) == hashlib.md5(data).hexdigest()
    assert check_local(entry, p, "eu-west-1") is None
    bad = bytearray(data)
    bad[1000] ^= 1
    p.write_bytes(bad)
    with pytest.raises(DataError, match=r"s\.tar: shard of region eu-west-1 does not match its manifest \(xxh3_128 or size differs\)"):
        check_local(entry, p, "eu-west-1")
    old = ShardEntry("s.tar", 1, len(data), hashlib.sha256(data).hexdigest())  # no fast hash: sha256
    with pytest.raises(DataError, match=r"\(sha256 or size differs\)"):
        check_local(old, p, "eu-west-1")
