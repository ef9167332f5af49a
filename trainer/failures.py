"""How the ranks' output and failures reach the user of ``geoshard train``.

Each rank that fails on purpose (a GeoshardError) records its one-line message and exit code in
``RUN_DIR/logs/error-rank{R}.json``; the launcher prints the first one once and exits with its
code; a rank that stops on any other exception records its type and first line
(``record_crash``), and the launcher records an agent or rank that a signal ended
(``record_stop``, ``RUN_DIR/logs/stopped.json``). torchrun's stderr and the ranks' (which they
inherit) go to ``RUN_DIR/logs/stderr.log``
whole, tracebacks included; only geoshard's own warnings are passed on to the terminal as they
happen, each distinct line once.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from geoshard.errors import GeoshardError

LOGS = "logs"
_ERROR_FILE = re.compile(r"^(error-rank(\d+)|stopped)\.json$")
_STOPPED = "stopped.json"  # the launcher's account of an agent that ended on a signal
# torchrun's failure report for a rank that died of a signal, and an agent's own end on one.
_RANK_LINE = re.compile(rb"^\s*rank\s*: (\d+) \(local_rank")
_RANK_SIGNAL = re.compile(rb"Signal \d+ \((SIG\w+)\) received by PID (\d+)")
_AGENT_SIGNAL = re.compile(rb"SignalException: Process \d+ got signal: (\d+)")
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
    _record(out, rank, error.exit_code, error.message, "error")


def record_crash(out: Path, rank: int, exc: BaseException) -> None:
    """Called by a rank that stopped on anything but a GeoshardError: a bug, or a value from the
    wire that nothing checked. Its line is the exception's type and first line."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    _record(out, rank, 1, f"{type(exc).__name__}: {first}" if first else type(exc).__name__, "crash")


def _record(out: Path, rank: int, code: int, message: str, kind: str) -> None:
    d = logs_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"rank": rank, "code": code, "message": message, "time": time.time(), "kind": kind}
    (d / f"error-rank{rank}.json").write_text(json.dumps(doc) + "\n")


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def record_stop(out: Path, where: str, returncode: int | None, relay: StderrRelay) -> bool:
    """The launcher, when an agent ended for good: what killed it or its rank, when a signal did
    (``where``: "region R: " or ""); whether it recorded. Nothing for an agent that exited on its own."""
    agent = f"{where}{'its' if where else 'the'} torchrun agent"
    if returncode is not None and returncode < 0:
        what = f"{agent} was killed by {signal_name(-returncode)}"
    elif relay.agent_signal is not None:
        what = f"{agent} was stopped by {signal_name(relay.agent_signal)}"
    elif relay.rank_signal is not None:
        name, pid, rank = relay.rank_signal
        what = f"{where}{'a rank' if rank is None else f'rank {rank}'} was killed by {name} (pid {pid})"
    else:
        return False
    d = logs_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / _STOPPED).write_text(json.dumps({"message": what}) + "\n")
    return True


def recorded_stop(out: Path) -> str | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads((logs_dir(out) / _STOPPED).read_text())["message"])
    return None


def clear_failures(out: Path) -> None:
    """Before a launch: a failure recorded by an earlier run of RUN_DIR is not this run's."""
    d = logs_dir(out)
    if d.is_dir():
        for p in d.iterdir():
            if _ERROR_FILE.match(p.name):
                p.unlink(missing_ok=True)


def first_failure(out: Path, kind: str = "error") -> RankFailure | None:
    """The failure of ``kind`` recorded first (the others are usually its consequences: a peer
    gone). "error": a rank's GeoshardError; "crash": anything else it stopped on."""
    found: list[tuple[float, RankFailure]] = []
    d = logs_dir(out)
    for p in d.iterdir() if d.is_dir() else ():
        if not _ERROR_FILE.match(p.name) or p.name == _STOPPED:
            continue
        try:
            doc = json.loads(p.read_text())
            if doc.get("kind", "error") != kind:
                continue
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
            # torchrun's own (ChildFailedError, SignalException) only says that something else failed
            if tail and not tail[0].startswith("torch.distributed.elastic."):
                return tail[0]
    return None


class StderrRelay:
    """Copies the ranks' stderr (a pipe) to ``RUN_DIR/logs/stderr.log``, and geoshard's warnings,
    each distinct line once, to ``sink`` (the terminal) as they come. One per torchrun agent; the
    relays of one job share ``seen``."""

    def __init__(self, pipe: IO[bytes], log: Path, sink: IO[str] | None = None, seen: set[bytes] | None = None) -> None:
        self.pipe, self.log = pipe, log
        self.sink = sink if sink is not None else sys.stderr
        # torchrun's report of a rank killed by a signal: (signal, pid, rank). Its last one is the
        # root cause (the others are the ranks the agent stopped after it).
        self.rank_signal: tuple[str, int, int | None] | None = None
        self._rank: int | None = None
        self.agent_signal: int | None = None  # the agent itself ended on this signal
        self.seen = seen if seen is not None else set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="geoshard-stderr-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with open(self.log, "ab") as f, contextlib.suppress(ValueError, OSError):  # the pipe closed under us by join()
            for line in iter(self.pipe.readline, b""):
                f.write(line)
                f.flush()
                self._note_signal(line)
                if _PASS_ON.match(line):
                    with self.lock:
                        if line in self.seen:
                            continue
                        self.seen.add(line)
                    self.sink.write(line.decode(errors="replace"))
                    self.sink.flush()

    def _note_signal(self, line: bytes) -> None:
        if m := _RANK_LINE.match(line):
            self._rank = int(m[1])
        elif m := _RANK_SIGNAL.search(line):
            self.rank_signal = (m[1].decode(), int(m[2]), self._rank)
        if self.agent_signal is None and (m := _AGENT_SIGNAL.search(line)):
            self.agent_signal = int(m[1])

    def join(self, timeout: float = 10.0) -> None:
        """After the agent exited: the rest of what its ranks wrote (orphans may hold the pipe: bounded)."""
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.pipe.close()
