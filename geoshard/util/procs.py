"""Ending processes: SIGTERM, a grace period, then SIGKILL, written once.

A target is a child this process started (``subprocess.Popen``: signalled and reaped through its
handle) or anything that signals and polls like one, such as the processes inside a network
namespace (``geoshard.wan.netns.Inside``). Each target is signalled as a whole: a Popen is one
process, not its group.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Protocol

POLL_S = 0.05


class Stoppable(Protocol):
    def send_signal(self, sig: int) -> None: ...
    def poll(self) -> int | None: ...  # None while it runs


def terminate(targets: Iterable[Stoppable], grace_s: float) -> None:
    """SIGTERM to every target still running, all at once; up to ``grace_s`` in all for them to end;
    then SIGKILL to the rest. A Popen killed is waited for (reaped) before this returns."""
    running = [t for t in targets if t.poll() is None]
    for t in running:
        t.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(t.poll() is None for t in running):
        time.sleep(POLL_S)
    for t in running:
        if t.poll() is None:
            t.send_signal(signal.SIGKILL)
            if isinstance(t, subprocess.Popen):
                t.wait()


def wait_or_kill(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for a child asked to stop another way (a message on its stdin);
    SIGKILL it after that, and reap it."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
