"""How the ranks' output and failures reach the user of ``geoshard train``.

Each rank that fails on purpose (a GeoshardError) records its one-line message and exit code in
``RUN_DIR/logs/error-rank{R}.json``; the launcher prints the first one once and exits with its
code. torchrun's stderr and the ranks' (which they inherit) go to ``RUN_DIR/logs/stderr.log``
whole, tracebacks included; only geoshard's own warnings are passed on to the terminal as they
happen, each distinct line once.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from geoshard.errors import GeoshardError

LOGS = "logs"
_ERROR_FILE = re.compile(r"^error-rank(\d+)\.json$")
# The ranks' logging format is "%(levelname)s %(name)s: %(message)s" (trainer/__main__.py).
_PASS_ON = re.compile(rb"^(WARNING|ERROR|CRITICAL) geoshard[.\w]*: ")


@dataclass(frozen=True)
class RankFailure:
    rank: int
    code: int
    message: str


class RankFailed(GeoshardError):
    """A rank stopped on a GeoshardError: the CLI exits with the rank's own code."""

    def __init__(self, failure: RankFailure) -> None:
        super().__init__(f"rank {failure.rank}: {failure.message}")
        self.exit_code = failure.code


def logs_dir(out: Path) -> Path:
    return out / LOGS


def record_failure(out: Path, rank: int, error: GeoshardError) -> None:
    """Called by the failing rank before it exits."""
    d = logs_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"rank": rank, "code": error.exit_code, "message": error.message, "time": time.time()}
    (d / f"error-rank{rank}.json").write_text(json.dumps(doc) + "\n")


def clear_failures(out: Path) -> None:
    """Before a launch: a failure recorded by an earlier run of RUN_DIR is not this run's."""
    d = logs_dir(out)
    if d.is_dir():
        for p in d.iterdir():
            if _ERROR_FILE.match(p.name):
                p.unlink(missing_ok=True)


def first_failure(out: Path) -> RankFailure | None:
    """The failure recorded first (the others are usually its consequences: a peer gone)."""
    found: list[tuple[float, RankFailure]] = []
    d = logs_dir(out)
    for p in d.iterdir() if d.is_dir() else ():
        if not _ERROR_FILE.match(p.name):
            continue
        try:
            doc = json.loads(p.read_text())
            failure = RankFailure(int(doc["rank"]), int(doc["code"]), str(doc["message"]))
            found.append((float(doc["time"]), failure))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return min(found, key=lambda x: (x[0], x[1].rank))[1] if found else None


def last_traceback_line(out: Path) -> str | None:
    """The last line of the last traceback in the run's stderr log (a rank that crashed)."""
    try:
        lines = (logs_dir(out) / "stderr.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback"):
            tail = [x for x in lines[i + 1 :] if x and not x.startswith((" ", "\t"))]
            return tail[0] if tail else None
    return None


class StderrRelay:
    """Copies the ranks' stderr (a pipe) to ``RUN_DIR/logs/stderr.log``, and geoshard's warnings,
    each distinct line once, to ``sink`` (the terminal) as they come. One per torchrun agent; the
    relays of one job share ``seen``."""

    def __init__(self, pipe: IO[bytes], log: Path, sink: IO[str] | None = None, seen: set[bytes] | None = None) -> None:
        self.pipe, self.log = pipe, log
        self.sink = sink if sink is not None else sys.stderr
        self.seen = seen if seen is not None else set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="geoshard-stderr-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with open(self.log, "ab") as f, contextlib.suppress(ValueError, OSError):  # the pipe closed under us by join()
            for line in iter(self.pipe.readline, b""):
                f.write(line)
                f.flush()
                if _PASS_ON.match(line):
                    with self.lock:
                        if line in self.seen:
                            continue
                        self.seen.add(line)
                    self.sink.write(line.decode(errors="replace"))
                    self.sink.flush()

    def join(self, timeout: float = 10.0) -> None:
        """After the agent exited: the rest of what its ranks wrote (orphans may hold the pipe: bounded)."""
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.pipe.close()
