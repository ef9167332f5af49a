"""Issue 20, part 2 and 6: a failure inside a rank ends ``geoshard train`` with that rank's own
line, never torchrun's ``ChildFailedError: ;``, and a killed rank or region says what happened
("killed by SIGKILL"), never ``Process N got signal: 15``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_diloco_train import EU, GEOSHARD, US, last_step, local_plan

FLAGS = ("--batch-size", "16", "--num-workers", "1", "--backend", "gloo", "--step-time", "0.1")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return local_plan(tmp_path_factory.mktemp("failures"), {US: 1, EU: 1}, samples=1200)


def train(plan: Path, out: Path, *args: object) -> list[str]:
    return [GEOSHARD, "train", "--plan", str(plan), "--out", str(out), *FLAGS, *map(str, args)]


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    """The command's one error line (geoshard's own warnings may come before it)."""
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("WARNING geoshard.")]
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert lines[0].startswith("geoshard: error: "), lines
    assert "ChildFailedError" not in r.stderr and "got signal" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def run_and_kill(argv: list[str], tmp: Path, victim: Callable[[], int | None]) -> subprocess.CompletedProcess[str]:
    """``argv`` as a user runs it; once ``victim()`` names a pid, SIGKILL it; stdout and stderr apart."""
    out, err = tmp / "stdout.log", tmp / "stderr.log"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e)
        try:
            deadline = time.monotonic() + 240
            while (pid := victim()) is None:
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            code = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


def find(out: Path, agent: bool, env: str) -> int | None:
    """A process of the run in ``out``: a torchrun agent or a rank, with ``env`` in its environment."""
    want = f"\0{env}\0".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = (entry / "cmdline").read_bytes()
            if str(out).encode() not in cmd or (b"torch.distributed.run" in cmd) != agent or b"geoshard.trainer" not in cmd:
                continue
            if want in b"\0" + (entry / "environ").read_bytes():
                return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    "job", [("--region", EU, "--nproc", "1"), ("--regions", f"{US}:1,{EU}:1", "--sync", "diloco")], ids=["ddp", "diloco"]
)
def test_a_rank_that_crashes_is_its_own_line(plan: Path, tmp_path: Path, job: tuple[str, ...]) -> None:
    out = tmp_path / "run"
    first = subprocess.run(
        train(plan, out, *job, "--steps", "4", "--checkpoint-every", "2", "--hidden", "64"), capture_output=True, text=True, check=False
    )
    assert first.returncode == 0, first.stderr[-3000:]
    # Resumed with another model width: loading the checkpoint's weights raises inside the rank (no GeoshardError).
    r = subprocess.run(train(plan, out, *job, "--steps", "6", "--resume", "--hidden", "128"), capture_output=True, text=True, check=False)
    line = one_line(r, 1)
    assert line.startswith("geoshard: error: rank ") and "RuntimeError: Error(s) in loading state_dict for Net" in line, line
    assert "Traceback" in (out / "logs" / "stderr.log").read_text()  # the whole story stays in the run folder


@pytest.mark.slow
@pytest.mark.parametrize(
    ("job", "where"),
    [(("--region", EU, "--nproc", "2"), ""), (("--regions", f"{US}:1,{EU}:1"), f"region {EU}: ")],
    ids=["one-region", "regions"],
)
def test_a_rank_killed_by_a_signal_says_so(plan: Path, tmp_path: Path, job: tuple[str, ...], where: str) -> None:
    out = tmp_path / "run"
    argv = train(plan, out, *job, "--steps", "200")
    r = run_and_kill(argv, tmp_path, lambda: find(out, False, "RANK=1") if last_step(out, 1) >= 2 else None)
    line = one_line(r, 1)
    assert f"training stopped: {where}rank 1 was killed by SIGKILL (pid " in line, line


@pytest.mark.slow
def test_a_killed_region_says_what_happened(plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = train(
        plan, out, "--regions", f"{US}:1,{EU}:1", "--sync", "diloco", "--steps", "30", "--outer-steps", "5", "--outer-timeout", "3"
    )
    # eu-west-1 is the job's rank 1; its agent is killed as a spot reclaim would, with no restart left.
    r = run_and_kill(argv, tmp_path, lambda: find(out, True, f"GEOSHARD_REGION={EU}") if last_step(out, 1) >= 2 else None)
    line = one_line(r, 1)
    assert f"training stopped: region {EU}: its torchrun agent was killed by SIGKILL" in line, line
