"""Checks of local shards against their manifest before anything leaves the machine."""

from __future__ import annotations

from pathlib import Path

from geoshard.errors import DataError
from geoshard.hashing import FAST, file_digests
from geoshard.manifest import ShardEntry


def check_local(shard: ShardEntry, path: Path, region: str, md5: bool = False) -> str | None:
    """Re-hash ``path`` with the manifest's fast hash (sha256 where it has none); a missing or
    altered shard is a DataError naming it. With ``md5``, the same pass also returns its MD5."""
    algorithm = FAST if shard.xxh3_128 else "sha256"
    try:
        digests, size = file_digests(path, algorithm, *(("md5",) if md5 else ()))
    except FileNotFoundError:
        raise DataError(f"{path}: shard of region {region} is missing locally; re-run geoshard split") from None
    if size != shard.bytes or digests[algorithm] != (shard.xxh3_128 if shard.xxh3_128 else shard.sha256):
        raise DataError(
            f"{path}: shard of region {region} does not match its manifest ({algorithm} or size differs); re-run geoshard split"
        )
    return digests.get("md5")


def md5_of(path: Path) -> str:
    """The ETag S3 gives a single-part upload of the file's bytes."""
    return file_digests(path, "md5")[0]["md5"]
