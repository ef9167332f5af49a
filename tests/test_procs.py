"""geoshard.util.procs.terminate: SIGTERM, a grace period shared by all targets, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from geoshard.util.procs import terminate

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def _child(code: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def test_sigterm_ends_what_obeys_it_and_sigkill_the_rest_after_one_grace_period_in_all() -> None:
    obeys = [_child("import time; print('ready', flush=True); time.sleep(60)") for _ in range(2)]
    stubborn = [_child(IGNORES_TERM) for _ in range(2)]
    t0 = time.monotonic()
    terminate([*obeys, *stubborn], grace_s=1.0)
    took = time.monotonic() - t0
    assert [p.returncode for p in obeys] == [-signal.SIGTERM] * 2
    assert [p.returncode for p in stubborn] == [-signal.SIGKILL] * 2  # killed and reaped
    assert 1.0 <= took < 5.0  # one grace period for all of them, not one each
    for p in [*obeys, *stubborn]:
        assert p.stdout is not None
        p.stdout.close()


def test_nothing_running_means_no_wait() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    t0 = time.monotonic()
    terminate([done], grace_s=10.0)
    assert time.monotonic() - t0 < 1.0 and done.returncode == 0
