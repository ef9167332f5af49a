"""CPU time of chosen processes and of the whole machine over a window, sampled from /proc
(bench/exchange_bench.py: who used the cores while an exchange ran, the forwarder or the ranks).

A process's time is its threads' user and system time (``/proc/PID/stat``); the machine's is every
core's non-idle time (``/proc/stat``), which also holds the kernel's packet work and other users'
jobs. Sampled every ``period_s`` so the share of the window the cores were saturated shows too.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence

TICK = os.sysconf("SC_CLK_TCK")
SATURATED = 0.95  # a sample interval counts as saturated when the cores were this busy


def process_seconds(pid: int) -> float | None:
    """User plus system seconds of ``pid`` and its threads so far; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of proc(5))


def machine_ticks() -> tuple[int, int]:
    """(busy, total) ticks over every core so far."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class CpuSampler:
    """Samples ``roles`` (name -> pids) and the machine from ``start`` to ``stop``."""

    def __init__(self, roles: Mapping[str, Sequence[int]], period_s: float = 0.5) -> None:
        self.roles, self.period_s = {k: list(v) for k, v in roles.items()}, period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[tuple[float, tuple[int, int], dict[str, float]]] = []

    def _sample(self) -> None:
        per = {role: sum(s for p in pids if (s := process_seconds(p)) is not None) for role, pids in self.roles.items()}
        self._samples.append((time.monotonic(), machine_ticks(), per))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, object]:
        """The window's summary: its seconds, the cores' busy share (of all of them), the share of
        sample intervals they were saturated, and each role's CPU seconds and cores used."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample()
        return summarize(self._samples)


def summarize(samples: Sequence[tuple[float, tuple[int, int], Mapping[str, float]]]) -> dict[str, object]:
    (t0, (b0, n0), p0), (t1, (b1, n1), p1) = samples[0], samples[-1]
    window = max(t1 - t0, 1e-9)
    shares = [(b - pb) / (n - pn) for (_, (pb, pn), _), (_, (b, n), _) in itertools.pairwise(samples) if n > pn]
    roles = {role: round(p1[role] - p0[role], 2) for role in p1}
    return {
        "window_s": round(window, 2),
        "busy": round((b1 - b0) / max(n1 - n0, 1), 3),
        "saturated": round(sum(s >= SATURATED for s in shares) / len(shares), 3) if shares else None,
        "cpu_s": roles,
        "cores": {role: round(v / window, 2) for role, v in roles.items()},
    }
