"""``geoshard s3 serve`` as a user runs it (issue 22, item 1): the real command in a subprocess,
its printed lines used to sync a split into it, Ctrl-C (SIGINT) stopping every server process,
a second run on the same folder serving the same objects, and its refusals in one line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import IO

import boto3
import pytest
from guaranteekit import GEOSHARD, assert_one_line, geoshard
from splitkit import REGIONS, make_corpus

from geoshard.local.ports import free_ports

BUCKETS = ",".join(REGIONS)  # region names are valid bucket names: one bucket per region


def _environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.pop("PYTHONPATH", None)
    return env


def _start(folder: Path, port: int) -> tuple[subprocess.Popen[str], list[str]]:
    """``geoshard s3 serve`` in the background; its stdout up to the line saying how to stop it."""
    proc = subprocess.Popen(
        [GEOSHARD, "s3", "serve", str(folder), "--buckets", BUCKETS, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environ(),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: lines.extend(_until_usage_end(stdout)), daemon=True)
    reader.start()
    reader.join(90)
    if not lines or lines[-1] != "Ctrl-C stops the server":
        proc.kill()
        raise AssertionError(f"no usage lines from s3 serve: {lines} {proc.communicate()}")
    return proc, lines


def _until_usage_end(stdout: IO[str]) -> list[str]:
    lines: list[str] = []
    for line in stdout:
        lines.append(line.rstrip("\n"))
        if lines[-1] == "Ctrl-C stops the server":
            break
    return lines


def _expected(folder: Path, port: int, access: str, secret: str) -> list[str]:
    return [
        f"geoshard s3 serve: S3 on http://127.0.0.1:{port} (127.0.0.1 only), data in {folder}",
        f"buckets: {', '.join(f's3://{r}' for r in REGIONS)}",
        "in the shell that runs geoshard split, sync, pull and train (keys generated for this server, kept in its folder):",
        f"export AWS_ENDPOINT_URL=http://127.0.0.1:{port}",
        f"export AWS_ACCESS_KEY_ID={access}",
        f"export AWS_SECRET_ACCESS_KEY={secret}",
        "export AWS_REGION=us-east-1",
        "Ctrl-C stops the server",
    ]


def _exports(lines: list[str]) -> dict[str, str]:
    return dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))


def _interrupt(proc: subprocess.Popen[str], folder: Path) -> None:
    """Ctrl-C: the command stops the server, says so, and exits 0."""
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err)
    assert out == f"stopping the server ...\nstopped; the data stays in {folder}\n"
    assert err == ""


def _processes_using(folder: Path) -> list[str]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if str(folder) in cmd:
                    found.append(f"{p.name}: {cmd}")
    return found


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _client(env: dict[str, str]):  # type: ignore[no-untyped-def]
    return boto3.session.Session().client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )


def _own_plan(path: Path) -> Path:
    """A user's plan: one bucket per region, no endpoint (AWS_ENDPOINT_URL names the server)."""
    regions = "\n".join(f'[regions.{r}]\nweight = 1\nbucket = "s3://{r}/train"' for r in REGIONS)
    path.write_text(f'[shards]\nbytes = "64KB"\n{regions}\n')
    return path


def test_serve_sync_ctrl_c_and_serve_again(tmp_path: Path) -> None:
    folder = tmp_path / "s3"
    (port,) = free_ports(1)
    proc, lines = _start(folder, port)
    try:
        env = _exports(lines)
        assert re.fullmatch(r"GSTEST[0-9A-F]{14}", env["AWS_ACCESS_KEY_ID"]) and len(env["AWS_SECRET_ACCESS_KEY"]) >= 40
        assert lines == _expected(folder, port, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])

        make_corpus(tmp_path / "corpus", samples=300, shard_samples=100)
        plan = _own_plan(tmp_path / "plan.toml")
        assert geoshard("split", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / "split", "--json", cwd=tmp_path).rc == 0
        r = geoshard("sync", tmp_path / "split", "--plan", plan, "--json", cwd=tmp_path, env=env)
        assert r.rc == 0, r.err
        published = {name: doc["published"] for name, doc in json.loads(r.out)["regions"].items()}
        assert published == dict.fromkeys(REGIONS, True)
        with contextlib.closing(_client(env)) as c:
            manifest = c.get_object(Bucket="eu-west-1", Key="train/manifest.json")["Body"].read()
        assert json.loads(manifest)["region"] == "eu-west-1"
    finally:
        _interrupt(proc, folder)
    assert _processes_using(folder) == []
    assert not _listens(port)

    proc, again = _start(folder, port)  # same folder: same keys, same objects
    try:
        assert again == lines
        with contextlib.closing(_client(env)) as c:
            assert c.get_object(Bucket="eu-west-1", Key="train/manifest.json")["Body"].read() == manifest
    finally:
        _interrupt(proc, folder)
    assert _processes_using(folder) == []
    assert not _listens(port)


def test_used_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = geoshard("s3", "serve", tmp_path / "s3", "--port", port)
    line = assert_one_line(r, 2)
    assert line == f"geoshard: error: --port {port}: 127.0.0.1:{port} is in use; stop what listens there or pass another --port"
    assert r.out == "" and not (tmp_path / "s3").exists()


def test_folder_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "s3").write_text("not a folder")
    r = geoshard("s3", "serve", tmp_path / "s3", "--port", free_ports(1)[0])
    line = assert_one_line(r, 2)
    assert line == f"geoshard: error: {tmp_path / 's3'}: is a file, not a folder; pass a folder for the server's data (created if missing)"
    assert r.out == ""


@pytest.mark.parametrize("bad", ["Upper", "ab", "a_b"])
def test_bad_bucket_name_is_one_line(tmp_path: Path, bad: str) -> None:
    r = geoshard("s3", "serve", tmp_path / "s3", "--buckets", f"ok-bucket,{bad}", "--port", free_ports(1)[0])
    line = assert_one_line(r, 2)
    assert line == (f"geoshard: error: --buckets: {bad!r} is not a bucket name (3-63 characters: lowercase letters, digits, dots, hyphens)")
    assert not (tmp_path / "s3").exists()
