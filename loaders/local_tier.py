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
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from geoshard.errors import ConfigError
from geoshard.loaders.tier import Progress, TierError, TierMissing
from geoshard.util.fsutil import temp_file
from geoshard.util.paths import is_shard_name, plain_relative

log = logging.getLogger(__name__)
# Address space of shard mappings a process keeps for their next fetch (file pages: the page cache's,
# reclaimable, never copied). A corpus this size or smaller is mapped once per process, not per epoch.
MAPPED_BYTES = 2 << 30


class LocalTier:
    kind = "local"
    writable = True

    def __init__(self, root: str | os.PathLike[str], region: str = "", limit_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.region = region
        self.name = f"local:{region}" if region else f"local:{self.root}"
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, tuple[tuple[int, int, int], mmap.mmap]] = OrderedDict()  # path -> (dev, ino, size), mapping
        self._mapped = 0
        self._maps_lock = threading.Lock()

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
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a corrupt copy, evicted): what was read stands
            os.utime(p)  # recency for eviction
        return data

    def view(self, path: str) -> bytes | mmap.mmap:
        """The shard memory-mapped: no copy into the process before its samples are cut out.

        Safe because replica files are only ever renamed over or unlinked, never truncated in place
        (a truncated mapping would fault). A mapping is kept for the next fetch of the same file
        (same device, inode and size; up to ``MAPPED_BYTES`` per process, least recently used
        dropped first): setting up a large mapping's page tables costs about as much as hashing it
        (docs/benchmarks.md, loaders section), and every fetch still checks the bytes (the chain
        verifies what this returns)."""
        p = self._path(path)
        with self._reading(path, p), open(p, "rb") as f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino, st.st_size)
            with self._maps_lock:
                kept = self._maps.get(path)
                if kept is not None and kept[0] == ident:
                    self._maps.move_to_end(path)
                    data: bytes | mmap.mmap = kept[1]
                else:
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else b""
                    self._keep(path, ident, data)
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a corrupt copy, evicted): what was read stands
            os.utime(p)  # recency for eviction
        return data

    def _keep(self, path: str, ident: tuple[int, int, int], data: bytes | mmap.mmap) -> None:
        # Dropping a mapping only drops this reference: views still holding it keep it mapped.
        self._forget(path)
        if not isinstance(data, mmap.mmap) or ident[2] > MAPPED_BYTES:
            return
        self._maps[path] = (ident, data)
        self._mapped += ident[2]
        while self._mapped > MAPPED_BYTES:
            _, (old, _) = self._maps.popitem(last=False)
            self._mapped -= old[2]

    def _forget(self, path: str) -> None:
        """Drop a kept mapping (its file is removed or replaced: never pin its disk space)."""
        kept = self._maps.pop(path, None)
        if kept is not None:
            self._mapped -= kept[0][2]

    def read_range(self, path: str, offset: int, length: int, progress: Progress | None = None) -> memoryview:
        """A view of the kept mapping (``view``): no copy; a local read has no progress to report."""
        return memoryview(self.view(path))[offset : offset + length]

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

    def remove_corrupt(self, path: str) -> None:
        self.remove(path)  # never serve a corrupt copy again

    def remove(self, path: str) -> None:
        p = self._path(path)
        if not is_shard_name(p.name):  # not a name this tier writes: the user's file, never ours to delete
            log.warning("%s: not removing %s: not a shard name", self.name, p)
            return
        with self._maps_lock:
            self._forget(path)
        p.unlink(missing_ok=True)

    def _evict(self, incoming: int, keep: Path) -> None:
        files = [f for f in self.root.rglob("*") if f.is_file() and is_shard_name(f.name) and f != keep]
        sizes = {f: f.stat() for f in files}
        used = sum(s.st_size for s in sizes.values())
        for f in sorted(files, key=lambda f: sizes[f].st_mtime):  # least recently used first
            if used + incoming <= self.limit_bytes:  # type: ignore[operator]
                break
            f.unlink(missing_ok=True)
            with self._maps_lock:
                self._forget(str(f.relative_to(self.root)))
            used -= sizes[f].st_size
