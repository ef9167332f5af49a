"""Guarantees of ``geoshard split`` (docs/guarantees.md), through the real command in a subprocess:
bad input or a failing environment gives one line and its exit code, publishes nothing, and
touches nothing outside --out; nothing is silently left out of a published split."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from guaranteekit import as_user, assert_one_line, geoshard, published, snapshot
from splitkit import make_corpus, write_plan
from test_dask_cluster import cluster  # noqa: F401 - real dask scheduler and worker processes

from geoshard.formats import tfrecord, wds


def _split(
    tmp: Path, source: Path, *extra: object, prefix: list[str] | None = None, env: dict[str, str] | None = None, plan: Path | None = None
):  # type: ignore[no-untyped-def]
    plan = plan or tmp / "plan.toml"
    if not plan.exists():
        write_plan(plan, shard_bytes="64KB")
    return geoshard("split", source, "--plan", plan, "--out", tmp / "out", *extra, cwd=tmp, prefix=prefix or [], env=env)


def _tar_cut_at_sample(path: Path, samples: int, keep: int) -> None:
    """A tar of ``samples`` samples cut exactly at the header of sample ``keep``: no end blocks."""
    buf = io.BytesIO()
    w = wds.TarWriter(buf)
    for i in range(samples):
        if i == keep:
            break
        w.write_sample([(b"k%05d.bin" % i, os.urandom(300)), (b"k%05d.cls" % i, b"%d" % (i % 10))])
    path.write_bytes(buf.getvalue())


# 1. Nothing is silently left out ----------------------------------------------------------------


@pytest.mark.parametrize("form", ["folder", "src/**/*.tar", "src/*/*.tar"])
def test_unreadable_subfolder_is_an_error_naming_it(tmp_path: Path, form: str) -> None:
    make_corpus(tmp_path / "gen", samples=1000, shard_samples=500)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    tars = sorted((tmp_path / "gen").glob("*.tar"))
    shutil.move(tars[0], src / tars[0].name)
    shutil.move(tars[1], src / "sub" / tars[1].name)
    (src / "sub").chmod(0)
    write_plan(tmp_path / "plan.toml", shard_bytes="64KB")
    before = snapshot(tmp_path, skip=tmp_path / "out")
    prefix, env = as_user(tmp_path)
    source = src if form == "folder" else tmp_path / form  # globs too: glob itself skips what it cannot list
    r = _split(tmp_path, source, "--workers", "1", prefix=prefix, env=env)
    assert_one_line(r, 1, f"{src / 'sub'}: cannot list source folder (Permission denied)")
    assert published(tmp_path / "out") == []
    assert snapshot(tmp_path, skip=tmp_path / "out") == before


def test_tar_cut_at_a_member_header_is_an_error_unless_allowed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_corpus(src, samples=500, shard_samples=500)
    _tar_cut_at_sample(src / "zz-cut.tar", 500, 250)
    write_plan(tmp_path / "plan.toml", shard_bytes="64KB")
    before = snapshot(tmp_path, skip=tmp_path / "out")
    r = _split(tmp_path, src, "--workers", "1")
    assert_one_line(r, 1, f"{src / 'zz-cut.tar'}: tar ends at byte", "without end-of-archive blocks")
    assert published(tmp_path / "out") == []
    assert snapshot(tmp_path, skip=tmp_path / "out") == before

    ok = _split(tmp_path, src, "--workers", "1", "--allow-truncated-tar", "--json")
    assert ok.rc == 0, ok.err
    assert (
        ok.err.strip() == f"geoshard: warning: {src / 'zz-cut.tar'}: tar ends without end-of-archive blocks; split the 250 samples it holds"
    )
    doc = json.loads(ok.out)
    assert doc["truncated"] == [{"source": str(src / "zz-cut.tar"), "samples": 250}]
    assert doc["samples_in"] == 750 and sum(x["samples"] for x in doc["regions"].values()) == 750


# 5. Bad input inside a split task: one line, no worker traceback ----------------------------------


def _frame_huge(length: int) -> bytes:
    head = struct.pack("<Q", length)
    return head + struct.pack("<I", tfrecord.masked_crc(head)) + b"x" * 100


def _tfrecords(n: int) -> bytes:
    return b"".join(tfrecord.frame(b"record %d" % i + b"." * 200) for i in range(n))


def _tar(members: list[tuple[bytes, bytes]]) -> bytes:
    buf = io.BytesIO()
    w = wds.TarWriter(buf)
    for name, data in members:
        w.write_member(name, data)
    w.close()
    return buf.getvalue()


def _gnu_huge_member() -> bytes:
    h = bytearray(wds.member_header(b"k0.bin", 0))
    h[124:136] = b"\x80" + (2**60).to_bytes(11, "big")  # GNU base-256 size
    h[148:156] = b" " * 8
    h[148:155] = b"%06o\0" % sum(h)
    return bytes(h) + b"y" * 4096


def _crc_broken() -> bytes:
    data = bytearray(_tfrecords(20))
    data[20] ^= 0xFF  # inside record 0's data
    return bytes(data)


BAD: dict[str, tuple[str, Callable[[], bytes], str]] = {
    "truncated-tfrecord": ("t.tfrecord", lambda: _tfrecords(20)[:-50], "truncated TFRecord at byte"),
    "crc-tfrecord": ("t.tfrecord", _crc_broken, "bad data CRC in record"),
    "huge-tfrecord-length": ("t.tfrecord", lambda: _tfrecords(3) + _frame_huge(2**40), f"record 3 declares {2**40} bytes"),
    "not-a-tar": ("t.tar", lambda: b"not a tar\n" * 200, "bad tar header checksum at byte 0; not a tar archive"),
    "orphan-member": ("t.tar", lambda: _tar([(b"a.jpg", b"1"), (b"README", b"2")]), "belongs to no sample"),
    "duplicate-key": ("t.tar", lambda: _tar([(b"a.jpg", b"1"), (b"b.jpg", b"2"), (b"a.jpg", b"3")]), "duplicate sample key 'a'"),
    "control-character": ("t.tar", lambda: _tar([(b"a\x01b.jpg", b"1")]), "contains a control character"),
    "non-utf8-key": ("t.tar", lambda: _tar([(b"a\xffb.jpg", b"1")]), "is not UTF-8"),
    "oversized-member": ("t.tar", lambda: _tar([(b"a.jpg", b"1" * 5000)])[:3000], "member declares 5000 bytes"),
    "gnu-2-60-member": ("t.tar", _gnu_huge_member, f"member declares {2**60} bytes"),
    "absolute-member": (
        "t.tar",
        lambda: _tar([(b"/etc/k.jpg", b"1")]),
        "'/etc/k.jpg' at byte 0 has an absolute path or a '..' part; refused",
    ),
    "dotdot-member": ("t.tar", lambda: _tar([(b"a.jpg", b"1"), (b"x/../../k.jpg", b"1")]), "'x/../../k.jpg' at byte 1024 has an absolute"),
}


def _worker_logs(base: Path) -> dict[Path, int]:
    """The real cluster's worker logs (tests/test_dask_cluster.py writes them) and their sizes."""
    return {p: p.stat().st_size for p in base.glob("dask-logs*/worker*.log")}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_in_a_task_is_one_line_on_a_real_cluster(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    cluster: str,  # noqa: F811
    case: str,
) -> None:
    name, make, words = BAD[case]
    src = tmp_path / "src"
    src.mkdir()
    (src / name).write_bytes(make())
    write_plan(tmp_path / "plan.toml", shard_bytes="64KB")
    before = snapshot(tmp_path, skip=tmp_path / "out")
    logs = _worker_logs(tmp_path_factory.getbasetemp())
    assert logs, "the cluster fixture's worker logs were not found"
    r = _split(tmp_path, src, "--scheduler", cluster)
    assert_one_line(r, 1, f"{src / name}: ", words)
    assert published(tmp_path / "out") == []
    assert snapshot(tmp_path, skip=tmp_path / "out") == before
    for log, size in logs.items():  # the workers logged no traceback either
        with open(log, "rb") as f:
            f.seek(size)
            new = f.read().decode(errors="replace")
        assert "Compute Failed" not in new and "DataError" not in new, new[-2000:]


@pytest.mark.parametrize("case", ["orphan-member", "duplicate-key", "huge-tfrecord-length", "gnu-2-60-member"])
def test_bad_input_in_a_task_is_one_line_on_the_in_process_cluster(tmp_path: Path, case: str) -> None:
    name, make, words = BAD[case]
    src = tmp_path / "src"
    src.mkdir()
    (src / name).write_bytes(make())
    r = _split(tmp_path, src, "--workers", "1")
    assert_one_line(r, 1, f"{src / name}: ", words)
    assert published(tmp_path / "out") == []


def test_infinite_weight_is_a_config_error(tmp_path: Path) -> None:
    make_corpus(tmp_path / "src", samples=50)
    plan = write_plan(tmp_path / "plan.toml", weights=(1, 1, float("inf")))
    r = _split(tmp_path, tmp_path / "src", "--workers", "1", plan=plan)
    assert_one_line(r, 2, "regions.ap-southeast-1.weight: must be a finite number > 0, got inf")
    assert not (tmp_path / "out").exists()


def test_unreadable_source_file_is_one_line(tmp_path: Path) -> None:
    make_corpus(tmp_path / "src", samples=100, shard_samples=50)
    victim = sorted((tmp_path / "src").glob("*.tar"))[1]
    victim.chmod(0)
    prefix, env = as_user(tmp_path)
    write_plan(tmp_path / "plan.toml", shard_bytes="64KB")
    before = snapshot(tmp_path, skip=tmp_path / "out")
    r = _split(tmp_path, victim.parent, "--workers", "1", prefix=prefix, env=env)
    assert_one_line(r, 1, f"{victim}: cannot read source (Permission denied)")
    assert published(tmp_path / "out") == []
    assert snapshot(tmp_path, skip=tmp_path / "out") == before


def test_unwritable_out_is_one_line(tmp_path: Path) -> None:
    make_corpus(tmp_path / "src", samples=100)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)  # no one may create --out inside it but with root's capabilities, which the command runs without
    prefix, env = as_user(tmp_path)
    plan = write_plan(tmp_path / "plan.toml")
    r = geoshard("split", tmp_path / "src", "--plan", plan, "--out", locked / "out", "--workers", "1", cwd=tmp_path, prefix=prefix, env=env)
    assert_one_line(r, 2, f"--out {locked / 'out'}: cannot write there (Permission denied)")
    assert not (locked / "out").exists()


def test_full_disk_is_one_line_and_publishes_nothing(tmp_path: Path) -> None:
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("needs unprivileged user and mount namespaces (for a private 1 MB tmpfs)")
    make_corpus(tmp_path / "src", samples=3000, sample_bytes=1000, shard_samples=1000)
    (tmp_path / "out").mkdir()
    plan = write_plan(tmp_path / "plan.toml", shard_bytes="256KB")
    # A 1 MB tmpfs as --out, in a private mount namespace of an unprivileged user namespace.
    prefix = [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        f'mount -t tmpfs -o size=1m tmpfs "{tmp_path / "out"}" && exec "$@"',
        "sh",
    ]
    before = snapshot(tmp_path, skip=tmp_path / "out")
    r = geoshard("split", tmp_path / "src", "--plan", plan, "--out", tmp_path / "out", "--workers", "1", cwd=tmp_path, prefix=prefix)
    assert_one_line(r, 1, "No space left on device", "the split was not published")
    assert snapshot(tmp_path, skip=tmp_path / "out") == before
    assert list((tmp_path / "out").iterdir()) == []  # the tmpfs went with its namespace: the real folder is untouched
