"""What a file looked like when its bytes last matched a digest: the quick check of a no-op run.

``pull`` (the replica's shards and indexes) and ``refresh`` (local sources) record, per file that
verified, its size, mtime, ctime and inode with the digest it matched. A later run re-hashes only
files whose record is missing, whose stat differs or whose expected digest changed: a no-op run
stats and compares, it reads no data. This is rsync's and s5cmd's quick check (size and mtime),
tightened by the ctime (no user can set it back, as ``touch -r`` sets the mtime) and the inode (a
file replaced by another). What it cannot see is a change that keeps all four (a disk's bit rot,
a write by a tool that restores ctime through the raw device): ``geoshard verify`` re-hashes
everything and is the explicit full check.

File timestamps come from a coarse clock (one kernel tick): a write in the same tick as the stat
could keep the stat unchanged. A file is recorded only once its ctime is older than ``RACY_NS``
before the stat (git's "racily clean" rule); ``settle`` waits that long after a run's own writes,
so the files a run just fetched are recorded too.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from geoshard.util.fsutil import write_atomic

log = logging.getLogger(__name__)
VERSION = 1
RACY_NS = 50_000_000  # well above a kernel tick (1-10 ms) of the coarse clock file times come from


@dataclass(frozen=True)
class FileStat:
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path | str) -> FileStat | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


class StatState:
    """Recorded (stat, digest tag) by name, loaded from and saved to one JSON file.

    A tag names what the bytes matched, e.g. ``xxh3_128:<hex>``; an unreadable or foreign state
    file is an empty state (everything is re-hashed once), never an error.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, tuple[FileStat, str]] = {}
        self.fresh: dict[str, tuple[FileStat, str]] = {}

    @classmethod
    def load(cls, path: Path) -> StatState:
        state = cls(path)
        try:
            data = json.loads(path.read_bytes())
            if data.get("version") == VERSION:
                for name, (size, mtime, ctime, ino, tag) in data["files"].items():
                    state.entries[str(name)] = (FileStat(int(size), int(mtime), int(ctime), int(ino)), str(tag))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            log.info("%s: unreadable (%s); every file is checked by its bytes", path, e)
            state.entries = {}
        return state

    def unchanged(self, name: str, file: Path | str, tag: str) -> bool:
        """Whether ``file`` still is what matched ``tag``; a match is kept for the next save."""
        got = self.entries.get(name)
        if got is None or got[1] != tag:
            return False
        now = FileStat.of(file)
        if now != got[0]:
            return False
        self.fresh[name] = got
        return True

    def record(self, name: str, file: Path | str, tag: str, seen: FileStat | None = None, renamed: bool = False) -> None:
        """``file`` matched ``tag``. With ``seen`` (its stat before it was read), it is recorded
        only when nothing changed it since (``renamed``: it was renamed into place after, which
        moves the ctime alone); racy entries (ctime too recent) are left out."""
        now = FileStat.of(file)
        if now is None or (seen is not None and (replace(now, ctime_ns=seen.ctime_ns) if renamed else now) != seen):
            return
        if now.ctime_ns > time.time_ns() - RACY_NS:
            return
        self.fresh[name] = (now, tag)

    def save(self) -> None:
        """Write what this run found or verified (entries not seen again are dropped)."""
        if self.fresh == self.entries:
            return  # a no-op run writes nothing
        files = {n: [s.size, s.mtime_ns, s.ctime_ns, s.ino, tag] for n, (s, tag) in sorted(self.fresh.items())}
        try:
            write_atomic(self.path, json.dumps({"version": VERSION, "files": files}, separators=(",", ":")).encode())
        except OSError as e:  # a read-only folder: the next run re-hashes
            log.info("cannot record file states in %s: %s", self.path, e)


def settle() -> None:
    """Wait until files written up to now are no longer racy, so ``record`` keeps them."""
    time.sleep(RACY_NS * 1.2 / 1e9)
