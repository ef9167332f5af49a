"""Which run a RUN_DIR belongs to, for ``StepLog``: ``RUN_DIR/run.json`` holds the run's id, and a
folder that already holds another run's files is refused (``geoshard report`` would mix the two
runs' ranks), unless the caller resumes that run.

Every rank looks at its folder before any rank writes, then the ranks agree in one collective:
all refuse together (none is left waiting in a later collective) and all take rank 0's run id.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from geoshard.errors import ConfigError
from geoshard.util.fsutil import write_atomic

RUN_FILE = "run.json"
_RUN_FILES = re.compile(r"^(steps-rank\d+\.jsonl|rank\d+\.json|rounds-.+\.jsonl|report\.json)$")


@dataclass(frozen=True)
class Found:
    """What one rank found in its RUN_DIR: the run files there, and the run's id (None: no
    ``run.json``, e.g. a ``geoshard train`` run)."""

    folder: str
    files: tuple[str, ...]
    run_id: str | None

    def refusal(self) -> str:
        """The one line that refuses to write into this folder."""
        shown = ", ".join(self.files[:3]) + (", ..." if len(self.files) > 3 else "")
        whose = f"run {self.run_id}" if self.run_id else "a run without a run id (geoshard train's, or an older StepLog's)"
        return f"{self.folder}: holds another run ({whose}: {shown}); pass resume=True to StepLog to append to it, or choose another folder"


def look(folder: Path) -> Found:
    files = tuple(sorted(p.name for p in folder.iterdir() if _RUN_FILES.match(p.name))) if folder.is_dir() else ()
    return Found(str(folder), files, read_run_id(folder))


def read_run_id(folder: Path) -> str | None:
    """The id in ``folder/run.json``; None when there is none (or it is unreadable: no id to name)."""
    try:
        doc = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run_id = doc.get("run_id") if isinstance(doc, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def decide(found: list[Found], resume: bool) -> str:
    """The run id every rank writes under (``found`` is every rank's look, rank 0 first), or a
    ConfigError refusing a folder that holds another run."""
    if resume:
        return next((f.run_id for f in found if f.run_id), None) or new_run_id()
    for f in found:
        if f.files:
            raise ConfigError(f.refusal())
    return new_run_id()


def claim(folder: Path, rank: int, world_size: int, resume: bool) -> str:
    """This rank's run id for ``folder`` (collective under torch.distributed: call it on every
    rank); rank 0 writes ``run.json``. Raises ConfigError on every rank when a folder holds
    another run and ``resume`` is not set."""
    mine = look(folder)
    found = _gather(mine)
    if len(found) == 1 and world_size > 1:
        # Ranks that cannot agree (no process group) would see each other's new files: each
        # judges only its own rank's.
        own = re.compile(rf"^(steps-rank{rank}\.jsonl|rank{rank}\.json)$")
        found = [Found(mine.folder, tuple(f for f in mine.files if own.match(f)), mine.run_id)]
    run_id = decide(found, resume)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0 and read_run_id(folder) != run_id:
        doc = {"run_id": run_id, "world_size": world_size, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_atomic(folder / RUN_FILE, json.dumps(doc).encode())
    return run_id


def _gather(mine: Found) -> list[Found]:
    """Every rank's look, by rank (only this one outside torch.distributed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return [mine]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list[Found | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [f for f in out if f is not None]
