"""Checks of local shards against their manifest before anything leaves the machine, and the S3
ETag the bucket should list for them (computed in the same read)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from geoshard.errors import DataError
from geoshard.manifest import ShardEntry
from geoshard.util.hashing import FAST, new

# s5cmd's default --part-size: an object up to it goes up in one PUT (ETag: the MD5 of its bytes),
# a larger one in parts of this size (ETag: the MD5 of the parts' MD5s, then "-" and the count).
PART_SIZE = 50 * 2**20
_READ = 4 << 20


class S3Etag:
    """The ETag S3 gives an upload of ``size`` bytes by s5cmd, fed the bytes in order."""

    def __init__(self, size: int, part_size: int = PART_SIZE) -> None:
        self.single = size <= part_size
        self.part_size = part_size
        self.md5 = hashlib.md5(usedforsecurity=False)
        self.parts: list[bytes] = []
        self.filled = 0

    def update(self, data: bytes | memoryview) -> None:
        if self.single:
            self.md5.update(data)
            return
        view = memoryview(data)
        while view:
            take = min(len(view), self.part_size - self.filled)
            self.md5.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.part_size:
                self.parts.append(self.md5.digest())
                self.md5, self.filled = hashlib.md5(usedforsecurity=False), 0

    def hexdigest(self) -> str:
        if self.single:
            return self.md5.hexdigest()
        parts = self.parts + ([self.md5.digest()] if self.filled else [])
        return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


def _read(path: Path, *sinks: object) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ)
        view = memoryview(buf)
        while got := f.readinto(buf):
            for s in sinks:
                s.update(view[:got])  # type: ignore[attr-defined]
            n += got
    return n


def check_local(shard: ShardEntry, path: Path, region: str, md5: bool = False) -> str | None:
    """Re-hash ``path`` with the manifest's fast hash (sha256 where it has none); a missing or
    altered shard is a DataError naming it. With ``md5``, the same pass also returns the S3 ETag
    of its bytes (their MD5 up to the part size, the multipart ETag beyond)."""
    algorithm = FAST if shard.xxh3_128 else "sha256"
    verifier = new(algorithm)
    etag = S3Etag(shard.bytes) if md5 else None
    try:
        size = _read(path, verifier, *((etag,) if etag else ()))
    except FileNotFoundError:
        raise DataError(f"{path}: shard of region {region} is missing locally; re-run geoshard split") from None
    if size != shard.bytes or verifier.hexdigest() != (shard.xxh3_128 if shard.xxh3_128 else shard.sha256):
        raise DataError(
            f"{path}: shard of region {region} does not match its manifest ({algorithm} or size differs); re-run geoshard split"
        )
    return etag.hexdigest() if etag else None


def etag_of(path: Path) -> str:
    """The ETag S3 lists for an s5cmd upload of the file's bytes."""
    etag = S3Etag(os.path.getsize(path))
    _read(path, etag)
    return etag.hexdigest()


def md5_of(path: Path) -> str:
    """The MD5 of the file's bytes (the ETag of a single-part upload)."""
    h = hashlib.md5(usedforsecurity=False)
    _read(path, h)
    return h.hexdigest()
