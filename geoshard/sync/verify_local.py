"""Checks of local shards against their manifest before anything leaves the machine."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from geoshard.errors import DataError
from geoshard.manifest import ShardEntry

_CHUNK = 1 << 20


@dataclass(frozen=True)
class LocalShard:
    entry: ShardEntry
    path: Path
    md5: str  # the ETag S3 gives a single-part upload of these bytes


def check_local(shard: ShardEntry, path: Path, region: str) -> LocalShard:
    """Re-hash ``path``; a missing or altered shard is a DataError naming it."""
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                md5.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise DataError(f"{path}: shard of region {region} is missing locally; re-run geoshard split") from None
    if size != shard.bytes or sha.hexdigest() != shard.sha256:
        raise DataError(f"{path}: shard of region {region} does not match its manifest (sha256 or size differs); re-run geoshard split")
    return LocalShard(shard, path, md5.hexdigest())
