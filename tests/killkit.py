"""Run a command as a user does and kill part of it mid-run (the tests of lost ranks and regions)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def run_and_kill(
    argv: list[str], log: Path, cwd: Path, victims: Callable[[], tuple[int, list[int]] | None], timeout: float = 400
) -> tuple[int, int]:
    """Run ``argv`` (output to ``log``); once ``victims()`` returns (progress, pids), SIGKILL those
    pids, then wait for the command. (exit status, the progress the kill came at)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
        try:
            killed_at = None
            deadline = time.monotonic() + 240
            while killed_at is None and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()[-3000:]
                found = victims()
                if found is not None and found[1]:
                    for pid in found[1]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    killed_at = found[0]
                time.sleep(0.05)
            assert killed_at is not None, "nothing was killed"
            return proc.wait(timeout=timeout), killed_at
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
                proc.kill()


def descendants(pid: int) -> list[int]:
    """Every living process under ``pid`` (Linux /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# What docs/cli.md tells a user to signal: torchrun starts ranks as ``python -u -m geoshard.trainer``
# (loader workers fork from them and keep it); its agents (``-m torch.distributed.run ... -m
# geoshard.trainer``) do not match, and SIGUSR1 would end them.
RANKS_PATTERN = "-u -m geoshard.trainer"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rank_processes(pid: int) -> list[int]:
    """The ranks and loader workers under ``pid`` that ``pkill -USR1 -f -- '-u -m geoshard.trainer'`` signals."""
    return [p for p in descendants(pid) if RANKS_PATTERN in _cmdline(p)]


def finish(job: subprocess.Popen[str], out: Path, timeout: float = 300) -> str:
    """``job``'s output (a ``geoshard train`` run into ``out``, stderr merged into stdout), once it
    ended with status 0; see :func:`finish_both`."""
    return finish_both(job, out, timeout)[0]


def finish_both(job: subprocess.Popen[str], out: Path, timeout: float = 300) -> tuple[str, str]:
    """``job``'s stdout and stderr (a ``geoshard train`` run into ``out``), once it ended with
    status 0. Past ``timeout`` every rank and loader worker prints its threads' stacks (SIGUSR1,
    the trainer's faulthandler) into the run's stderr log, the job is killed with all it started,
    and the test fails with the ends of its output and of that log: where it hung, not only that
    it did (and no job left running into the next test)."""
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in rank_processes(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.3)  # one at a time: processes dumping at once mix their lines in the shared log
        tree = descendants(job.pid)
        time.sleep(3)  # the stacks reach the log through the launcher's relay
        for pid in [job.pid, *tree]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        log = out / "logs" / "stderr.log"
        stacks = log.read_text(errors="replace")[-12000:] if log.exists() else "(no stderr log)"
        said = (stdout or "")[-3000:] + (stderr or "")[-3000:]
        raise AssertionError(f"no end in {timeout} s; output:\n{said}\nstderr log:\n{stacks}") from None
    assert job.returncode == 0, (stdout or "")[-3000:] + (stderr or "")[-3000:]
    return stdout or "", stderr or ""
