"""``geoshard refresh``: the nightly job. Split what changed, sync, write a run report.

One refresh per output folder at a time: a second one exits 75 (EX_TEMPFAIL) naming the holder.
The lock is an ``flock`` on ``DIR/.geoshard-refresh.lock``, which the kernel releases when its
holder dies, so the lock of a killed run is taken over by the next one. A killed refresh leaves
each region either on its previous or its new manifest; the rerun converges because split output
is deterministic and sync uploads only what the bucket lacks.

A refresh whose local sources all stat as they did when they last matched the manifest's digests
(``DIR/.geoshard-sources-state.json``: size, mtime, ctime, inode; geoshard/sync/stat_state.py)
does not run the split at all: it lists the sources, compares, and goes on to the (no-op) sync,
so a quiet night reads no source bytes. A source whose stat changed, an S3 source, a different
plan layout or a folder without a record goes through the split's own check, which re-hashes the
sources whose size is unchanged.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from geoshard.errors import DataError, LockedError
from geoshard.manifest import MANIFEST, Manifest, read_manifest
from geoshard.plan import Plan
from geoshard.split import SplitSettings, run_split
from geoshard.split.sources import SourceRef, expand_sources, refuse_out_inside
from geoshard.sync.push import SyncReport, SyncSettings, sync
from geoshard.sync.stat_state import FileStat, StatState
from geoshard.sync.transfer import Transferer
from geoshard.util.fsutil import write_atomic

log = logging.getLogger(__name__)
LOCK = ".geoshard-refresh.lock"
REPORTS = "reports"
SOURCES_STATE = ".geoshard-sources-state.json"


@dataclass(frozen=True)
class RefreshSettings:
    split: SplitSettings
    sync: SyncSettings
    report: Path | None = None  # default: DIR/reports/refresh-<time>.json


@contextmanager
def refresh_lock(out: Path) -> Iterator[None]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise LockedError(f"{out}: another geoshard refresh (pid {holder}) is running; this run exits without changes") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@dataclass
class RefreshReport:
    started: str
    seconds: float
    split: dict[str, Any]
    sync: SyncReport | None

    @property
    def ok(self) -> bool:
        return self.sync is None or self.sync.ok

    def to_dict(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "ok": self.ok,
            "split": self.split,
            "sync": self.sync.to_dict() if self.sync else None,
        }


def refresh(sources: Sequence[str], plan: Plan, settings: RefreshSettings, transferer: Transferer | None = None) -> RefreshReport:
    out = settings.split.out
    started = datetime.now(UTC)
    t0 = time.monotonic()
    with refresh_lock(out):
        split_part = _split(sources, plan, settings.split)
        report = RefreshReport(started.isoformat(timespec="seconds"), 0.0, split_part, None)
        report.sync = sync(out, plan, settings.sync, transferer)
        report.seconds = time.monotonic() - t0
        path = settings.report or out / REPORTS / f"refresh-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
        write_atomic(path, (json.dumps(report.to_dict(), indent=1) + "\n").encode())
        log.info("refresh report written to %s", path)
    return report


def _split(sources: Sequence[str], plan: Plan, settings: SplitSettings) -> dict[str, Any]:
    """The split's part of the report: nothing read when every source stats as recorded, else
    the incremental split (which re-hashes same-size sources), then the record updated."""
    t0 = time.monotonic()
    out = settings.out
    state = StatState.load(out / SOURCES_STATE)
    previous = _previous(out, plan, settings)
    refs = expand_sources(sources, settings.fmt, settings.s3)
    if previous is not None and _unchanged(refs, previous, state):
        refuse_out_inside(sources, out)  # as the split would
        part = {"generation": previous.generation, "unchanged": True, "groups_run": [], "samples_split": 0, "bytes_split": 0}
        return part | {"seconds": round(time.monotonic() - t0, 3), "sources_checked": "stat", "source_bytes_hashed": 0}
    local = [r for r in refs if not r.url.startswith("s3://")]
    seen = {r.url: FileStat.of(r.url) for r in local}
    result = run_split(sources, plan, settings)
    sizes = {s.url: s.size for s in previous.sources} if previous is not None else {}
    hashed = sum(r.size for r in refs if sizes.get(r.url) == r.size)
    state = StatState(out / SOURCES_STATE)
    for s in result.manifest.sources:
        stat = seen.get(s.url)
        if stat is not None and stat.size == s.size:
            state.record(s.url, s.url, _tag(s.xxh3_128, s.sha256), stat)
    state.save()
    return {
        "generation": result.manifest.generation,
        "unchanged": result.unchanged,
        "groups_run": list(result.groups_run),
        "samples_split": result.samples_in,
        "bytes_split": result.bytes_in,
        "seconds": round(result.seconds, 3),
        "sources_checked": "hash",
        "source_bytes_hashed": hashed,  # an upper bound: the sources whose size matched the manifest
    }


def _previous(out: Path, plan: Plan, settings: SplitSettings) -> Manifest | None:
    """The split in ``out`` when the quick check may stand in for the split's own, else None."""
    if not settings.incremental or settings.replace or not (out / MANIFEST).is_file():
        return None
    try:
        previous = read_manifest(out)
    except DataError:
        return None  # the split names the problem
    return previous if previous.layout_sha256 == plan.layout_sha256() and previous.sources else None


def _unchanged(refs: Sequence[SourceRef], previous: Manifest, state: StatState) -> bool:
    """Every source is local, the same set as the manifest's, each of the recorded size and stat."""
    recorded = {s.url: s for s in previous.sources}
    if not refs or {r.url for r in refs} != set(recorded) or any(r.format != previous.format for r in refs):
        return False
    for r in refs:
        s = recorded[r.url]
        if r.url.startswith("s3://") or r.size != s.size or not state.unchanged(r.url, r.url, _tag(s.xxh3_128, s.sha256)):
            return False
    return True


def _tag(xxh3: str, sha256: str) -> str:
    return f"xxh3_128:{xxh3}" if xxh3 else f"sha256:{sha256}"
