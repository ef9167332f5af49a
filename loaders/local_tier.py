"""The local replica: a folder laid out like a region of a split (manifest paths under ``root``).

Writes are atomic (temporary name, then rename), and with ``limit_bytes`` the least recently used
shards are evicted to make room, so write-back from S3 never fills the disk. The tier removes
(as a corrupt copy, or to evict) only files of geoshard's shard name pattern: the replica may
share its folder with the user's own files, and a manifest cannot make it delete them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from geoshard.loaders.tier import TierError, TierMissing

from geoshard.errors import ConfigError
from geoshard.manifest import temp_file
from geoshard.paths import is_shard_name, plain_relative

log = logging.getLogger(__name__)


class LocalTier:
    kind = "local"

    def __init__(self, root: str | os.PathLike[str], region: str = "", limit_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.region = region
        self.name = f"local:{region}" if region else f"local:{self.root}"
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()

    def _path(self, path: str) -> Path:
        try:
            return self.root / plain_relative(path, self.name)
        except ConfigError as e:
            raise TierError(f"{self.name}: refusing path {path!r} outside the replica") from e

    def stat(self, path: str) -> int | None:
        try:
            return self._path(path).stat().st_size
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def _reading(self, path: str, p: Path) -> Iterator[None]:
        """OS errors as the chain's: absent is a miss, anything else a failing tier."""
        try:
            yield
        except FileNotFoundError:
            raise TierMissing(f"{self.name}: {path} not in the replica") from None
        except OSError as e:
            raise TierError(f"{self.name}: cannot read {p}: {e.strerror}") from e

    def read(self, path: str) -> bytes:
        p = self._path(path)
        with self._reading(path, p):
            data = p.read_bytes()
        os.utime(p)  # recency for eviction
        return data

    def map(self, path: str) -> bytes | mmap.mmap:
        """The shard memory-mapped: no copy into the process before its samples are cut out.

        Safe because replica files are only ever renamed over or unlinked, never truncated in place
        (a truncated mapping would fault)."""
        p = self._path(path)
        with self._reading(path, p), open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        os.utime(p)  # recency for eviction
        return data

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        p = self._path(path)
        with self._reading(path, p), open(p, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def write(self, path: str, data: bytes) -> None:
        p = self._path(path)
        with self._lock:
            if self.limit_bytes is not None:
                self._evict(len(data), keep=p)
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = temp_file(p.parent, prefix=f".{p.name}.", suffix=".partial")  # mode by umask, not mkstemp's 0600
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, p)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    def remove(self, path: str) -> None:
        p = self._path(path)
        if not is_shard_name(p.name):  # not a name this tier writes: the user's file, never ours to delete
            log.warning("%s: not removing %s: not a shard name", self.name, p)
            return
        p.unlink(missing_ok=True)

    def _evict(self, incoming: int, keep: Path) -> None:
        files = [f for f in self.root.rglob("*") if f.is_file() and is_shard_name(f.name) and f != keep]
        sizes = {f: f.stat() for f in files}
        used = sum(s.st_size for s in sizes.values())
        for f in sorted(files, key=lambda f: sizes[f].st_mtime):  # least recently used first
            if used + incoming <= self.limit_bytes:  # type: ignore[operator]
                break
            f.unlink(missing_ok=True)
            used -= sizes[f].st_size
