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
