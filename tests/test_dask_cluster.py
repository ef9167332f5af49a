"""``geoshard split --scheduler`` on a cluster of real ``dask scheduler`` and ``dask worker``
processes on loopback, as a user would run one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from splitkit import make_corpus, tree_digest, write_plan

from geoshard.cli import main

DASK = str(Path(sys.executable).with_name("dask"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    logs = tmp_path_factory.mktemp("dask-logs")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(logs / "scheduler.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address", ":0", "--no-show"],
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            )
        for i in range(2):
            with open(logs / f"worker{i}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [DASK, "worker", address, "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard", "--name", f"w{i}"],
                        stdout=log,
                        stderr=log,
                        start_new_session=True,
                    )
                )
        from distributed import Client

        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(address, timeout="5s") as c:
                    if len(c.scheduler_info()["workers"]) == 2:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("dask cluster did not come up: " + (logs / "scheduler.log").read_text()[-2000:])
            time.sleep(0.5)
        yield address
    finally:
        for p in reversed(procs):
            _stop(p)


def test_split_on_external_cluster_matches_in_process(tmp_path: Path, cluster: str) -> None:
    make_corpus(tmp_path / "c", samples=2000, shard_samples=200)
    plan = write_plan(tmp_path / "plan.toml", shard_bytes="64KB")
    env = {"SOURCE_DATE_EPOCH": "1767225600"}
    runner = CliRunner()
    r = runner.invoke(
        main, ["split", str(tmp_path / "c"), "--plan", str(plan), "--out", str(tmp_path / "ext"), "--scheduler", cluster], env=env
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        main, ["split", str(tmp_path / "c"), "--plan", str(plan), "--out", str(tmp_path / "local"), "--workers", "1"], env=env
    )
    assert r.exit_code == 0, r.output
    assert tree_digest(tmp_path / "ext") == tree_digest(tmp_path / "local")
    assert (tmp_path / "ext" / "manifest.json").read_bytes() == (tmp_path / "local" / "manifest.json").read_bytes()


def test_data_error_on_a_worker_is_one_line(tmp_path: Path, cluster: str) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "bad.tar").write_text("not a tar\n" * 200)
    r = CliRunner().invoke(
        main,
        [
            "split",
            str(tmp_path / "c"),
            "--plan",
            str(write_plan(tmp_path / "p.toml")),
            "--out",
            str(tmp_path / "o"),
            "--scheduler",
            cluster,
        ],
    )
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "bad.tar: bad tar header checksum at byte 0" in r.stderr


def test_unreachable_scheduler_is_a_usage_error(tmp_path: Path) -> None:
    make_corpus(tmp_path / "c", samples=10)
    addr = f"tcp://127.0.0.1:{_free_port()}"
    r = CliRunner().invoke(
        main,
        ["split", str(tmp_path / "c"), "--plan", str(write_plan(tmp_path / "p.toml")), "--out", str(tmp_path / "o"), "--scheduler", addr],
    )
    assert r.exit_code == 2 and f"--scheduler {addr}: cannot connect" in r.stderr
