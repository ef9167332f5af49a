"""Checks of local shards against their manifest before anything leaves the machine."""

from __future__ import annotations

from pathlib import Path

from geoshard.errors import DataError
from geoshard.manifest import ShardEntry
from geoshard.verify import file_digests


def check_local(shard: ShardEntry, path: Path, region: str) -> None:
    """Re-hash ``path`` with sha256; a missing or altered shard is a DataError naming it."""
    try:
        digests, size = file_digests(path, "sha256")
    except FileNotFoundError:
        raise DataError(f"{path}: shard of region {region} is missing locally; re-run geoshard split") from None
    if size != shard.bytes or digests["sha256"] != shard.sha256:
        raise DataError(f"{path}: shard of region {region} does not match its manifest (sha256 or size differs); re-run geoshard split")


def md5_of(path: Path) -> str:
    """The ETag S3 gives a single-part upload of the file's bytes."""
    return file_digests(path, "md5")[0]["md5"]
