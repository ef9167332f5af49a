"""The chunk indexes of a version 2 region (``<shard>.chunks``, docs/manifest.md) go up with their
shards: those of the shards this run uploads, and any the bucket's listing lacks. Each is checked
against the digest its manifest records before it leaves, as a shard is. A no-op re-sync finds
them all in the listing and reads nothing.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from geoshard.errors import SyncError
from geoshard.manifest import RegionManifest, ShardEntry, chunkindex

log = logging.getLogger(__name__)
_PUTS = 16  # small objects: latency-bound, so many at once


class _Puts(Protocol):
    def put(self, path: str, data: bytes, content_type: str = ...) -> None: ...


def upload_chunk_indexes(bucket: _Puts, root: Path, local: RegionManifest, listed: set[str], uploaded: list[ShardEntry]) -> int:
    """Upload the indexes ``local`` needs that the bucket lacks or whose shard went up this run;
    their count. A local index that does not match its manifest stops the sync before any goes."""
    fresh = {s.path for s in uploaded}
    todo = [s for s in local.shards if s.chunk_index and (s.path in fresh or chunkindex.index_name(s.path) not in listed)]
    if not todo:
        return 0
    bodies = [_checked(root, s) for s in todo]
    with ThreadPoolExecutor(max_workers=_PUTS) as pool:
        list(
            pool.map(
                lambda sb: bucket.put(chunkindex.index_name(sb[0].path), sb[1], "application/octet-stream"), zip(todo, bodies, strict=True)
            )
        )
    log.info("%s: %d chunk index(es) uploaded", local.region, len(todo))
    return len(todo)


def _checked(root: Path, s: ShardEntry) -> bytes:
    path = root / chunkindex.index_name(s.path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SyncError(f"{path}: cannot read the chunk index of {s.path} ({e.strerror}); re-split, manifest not published") from e
    if chunkindex.digest(data) != s.chunk_index:
        raise SyncError(f"{path}: does not match the chunk_index its manifest records; re-split, manifest not published")
    return data
