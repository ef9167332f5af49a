"""``geoshard refresh``: the nightly job. Split what changed, sync, write a run report.

One refresh per output folder at a time: a second one exits 75 (EX_TEMPFAIL) naming the holder.
The lock is an ``flock`` on ``DIR/.geoshard-refresh.lock``, which the kernel releases when its
holder dies, so the lock of a killed run is taken over by the next one. A killed refresh leaves
each region either on its previous or its new manifest; the rerun converges because split output
is deterministic and sync uploads only what the bucket lacks.
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

from geoshard.errors import LockedError
from geoshard.plan import Plan
from geoshard.split import SplitSettings, run_split
from geoshard.sync.push import SyncReport, SyncSettings, sync
from geoshard.sync.transfer import Transferer
from geoshard.util.fsutil import write_atomic

log = logging.getLogger(__name__)
LOCK = ".geoshard-refresh.lock"
REPORTS = "reports"


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
        result = run_split(sources, plan, settings.split)
        split_part = {
            "generation": result.manifest.generation,
            "unchanged": result.unchanged,
            "groups_run": list(result.groups_run),
            "samples_split": result.samples_in,
            "bytes_split": result.bytes_in,
            "seconds": round(result.seconds, 3),
        }
        report = RefreshReport(started.isoformat(timespec="seconds"), 0.0, split_part, None)
        report.sync = sync(out, plan, settings.sync, transferer)
        report.seconds = time.monotonic() - t0
        path = settings.report or out / REPORTS / f"refresh-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
        write_atomic(path, (json.dumps(report.to_dict(), indent=1) + "\n").encode())
        log.info("refresh report written to %s", path)
    return report
