"""The split's speed levers keep its guarantees: the reused read window gives the bytes a plain
window gives, the default in-process cluster of threads gives the same split, byte for byte, as
worker processes, and bad input stays one line on both (docs/benchmarks.md, `geoshard split` vs
`cp -r`). The real ``dask scheduler``/``dask worker`` processes are in test_guarantees_split.py."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
from guaranteekit import GEOSHARD, assert_one_line, geoshard, published
from splitkit import make_corpus, read_corpus, region_shards, tree_digest, write_plan

from geoshard.formats import wds
from geoshard.formats._window import ReusedWindow, Window
from geoshard.manifest.verify import verify_split
from geoshard.plan.routing import NSLOTS, slot_table


class _ReadOnly:
    """A stream with ``read`` only (an S3 body): the reused window copies what it returns."""

    def __init__(self, data: bytes) -> None:
        self.f = io.BytesIO(data)

    def read(self, n: int = -1, /) -> bytes:
        return self.f.read(min(n, 7000) if n > 0 else n)  # short reads, as a socket gives


@pytest.mark.parametrize("stream", [io.BytesIO, _ReadOnly])
def test_reused_window_gives_the_bytes_and_offsets_of_a_plain_window(stream: type) -> None:
    data = os.urandom(300_000)
    plain, reused = Window(io.BytesIO(data), chunk=4096), ReusedWindow(stream(data), chunk=4096)
    rng = random.Random(1)
    while True:
        n = rng.choice([1, 512, 4096, 5000, 20_000, 70_000])  # 70,000: past the kept buffer, which grows
        ok = plain.fill(n)
        assert reused.fill(n) == ok
        assert reused.offset == plain.offset and (reused.remaining() >= n) == ok  # short reads may leave it fewer extra bytes
        assert bytes(reused.buf[reused.pos :]) == data[reused.offset : reused.offset + reused.remaining()]
        if not ok:
            break
        step = rng.randrange(0, n + 1)
        plain.pos += step
        reused.pos += step
    assert reused.offset + reused.remaining() == len(data)
    # The member-by-member reader takes over with a copy of what was not parsed yet.
    reused = ReusedWindow(stream(data), chunk=4096)
    reused.fill(10_000)
    reused.pos = 3000
    rest = reused.detach()
    assert rest.offset == 3000 and isinstance(rest.buf, bytes)
    assert rest.fill(len(data) - 3000) and rest.buf[rest.pos :] == data[3000:]


def test_reused_window_overwrites_in_place_even_when_what_is_left_overlaps() -> None:
    data = bytes(range(256)) * 100
    w = ReusedWindow(io.BytesIO(data), chunk=1000)
    assert w.fill(1500)  # 2000 bytes read
    w.pos = 700  # 1300 left: more than the 700 consumed, so the move overlaps
    assert w.fill(1500)
    assert bytes(w.buf[w.pos : w.pos + 1500]) == data[700:2200] and w.offset == 700


def _stdlib_tar(samples: int, fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i in range(samples):
            for ext, body in ((b"img", os.urandom(3000 + i)), (b"cls", b"%d" % i)):
                info = tarfile.TarInfo(f"s{i:05d}.{ext.decode()}")
                info.size = len(body)
                tf.addfile(info, io.BytesIO(body))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_raw_windows_with_a_reused_buffer_give_the_same_samples_and_bytes_keys(fmt: int) -> None:
    data = _stdlib_tar(3000, fmt)  # ~10 MB: several 4 MiB windows; PAX takes the member-by-member path

    def samples(reuse: bool) -> list[tuple[bytes, bytes]]:
        out = []
        for buf, keys, starts, ends in wds.iter_raw_windows(io.BytesIO(data), "t", size=len(data), reuse=reuse):
            out += [(k, bytes(buf[s:e])) for k, s, e in zip(keys, starts, ends, strict=True)]  # copied before the next fill
        return out

    plain, reused = samples(False), samples(True)
    assert reused == plain and len(plain) == 3000
    assert all(type(k) is bytes for k, _ in reused) and len({k for k, _ in reused}) == 3000  # hashable, distinct


def _cli_split(tmp: Path, src: Path, out: str, *extra: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return geoshard("split", src, "--plan", tmp / "plan.toml", "--out", tmp / out, "--json", *extra, cwd=tmp, env=env)


def test_split_runs_on_threads_by_default_and_worker_processes_give_the_same_bytes(tmp_path: Path) -> None:
    # Samples of ~300 KB in 18 MB sources: windows of 4 MiB end mid-sample, so every window's
    # leftover moves to the front of the reused buffer while writers still have shards open.
    make_corpus(tmp_path / "src", samples=120, sample_bytes=300_000, shard_samples=60)
    write_plan(tmp_path / "plan.toml", shard_bytes="2MB")
    env_fixed = {"SOURCE_DATE_EPOCH": "1767225600"}
    runs = {}
    for out, extra in (("threads", ()), ("processes", ("--processes",)), ("threads2", ("--threads", "--workers", "1"))):
        r = _cli_split(tmp_path, tmp_path / "src", out, *extra, env=env_fixed)
        assert r.rc == 0 and r.err == "", r.err[-3000:]
        runs[out] = json.loads(r.out)
    assert runs["threads"]["cluster"] == "threads" and runs["threads2"]["cluster"] == "threads"
    assert runs["processes"]["cluster"] == "processes"
    for doc in runs.values():
        assert doc["samples_in"] == 120 and doc["cluster_seconds"] >= 0 and doc["job_seconds"] > 0
    digests = [tree_digest(tmp_path / out) for out in runs]
    assert digests[0] == digests[1] == digests[2] and len(digests[0]) > 10  # every shard and region manifest
    tops = {(tmp_path / out / "manifest.json").read_bytes() for out in runs}
    assert len(tops) == 1
    # Every sample once, byte for byte: a view written after its window was refilled would differ.
    written = read_corpus([p for paths in region_shards(tmp_path / "threads").values() for p in paths], "wds")
    assert written == read_corpus(sorted((tmp_path / "src").glob("*.tar")), "wds") and sum(written.values()) == 120
    regions, report = verify_split(tmp_path / "threads", "sha256")
    assert report.ok and report.checked == sum(len(rm.shards) for rm in regions.values()) > 10


@pytest.mark.parametrize("kind", [(), ("--threads",), ("--processes",)], ids=["default", "threads", "processes"])
def test_bad_input_is_one_line_on_threads_and_on_worker_processes(tmp_path: Path, kind: tuple[str, ...]) -> None:
    src = tmp_path / "src"
    make_corpus(src, samples=400, shard_samples=200)
    tars = sorted(src.glob("*.tar"))
    tars[1].write_bytes(tars[0].read_bytes())  # the same keys in two sources: found across groups
    (src / "z-cut.tar").write_bytes(tars[0].read_bytes()[:-3000])  # and a tar cut inside a member
    write_plan(tmp_path / "plan.toml", shard_bytes="64KB")
    r = _cli_split(tmp_path, src, "out", *kind)
    assert_one_line(r, 1, "z-cut.tar: truncated tar at byte")
    assert r.out == "" and published(tmp_path / "out") == []
    assert not (tmp_path / "out" / ".geoshard-tmp").exists()  # no task wrote on after the failure
    (src / "z-cut.tar").unlink()
    r = _cli_split(tmp_path, src, "out", *kind)  # found by a second task (find_key) on the same scheduler
    assert_one_line(r, 1, "duplicate sample key", str(tars[0]), str(tars[1]))
    assert r.out == "" and published(tmp_path / "out") == []
    assert not (tmp_path / "out" / ".geoshard-tmp").exists()


# What `geoshard split` imports, reported by a fresh Python that runs the CLI's main in-process.
_REPORT_MODULES = """
import json, sys
from geoshard.cli import main
try:
    main(sys.argv[2:])
except SystemExit as e:
    code = e.code
watch = sys.argv[1].split(",")
print(json.dumps({"exit": code, "loaded": [m for m in watch if m in sys.modules]}), file=sys.stderr)
"""
_HEAVY = ("distributed", "boto3", "botocore", "torch", "pandas", "tensorflow")
_OTHER_COMMANDS = ("geoshard.cli.sync", "geoshard.cli.train", "geoshard.cli.report", "geoshard.cli.wan", "geoshard.sync.push")


def _modules_after(tmp: Path, *args: object) -> tuple[dict, str]:  # type: ignore[type-arg]
    watch = ",".join(("dask", "dask.threaded", *_HEAVY, *_OTHER_COMMANDS))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        [sys.executable, "-P", "-c", _REPORT_MODULES, watch, *(str(a) for a in args)],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=300,
        check=False,
    )
    return json.loads(p.stderr.strip().splitlines()[-1]), p.stdout


def test_the_default_split_runs_on_dasks_threaded_scheduler_without_importing_distributed(tmp_path: Path) -> None:
    make_corpus(tmp_path / "src", samples=300, sample_bytes=20_000, shard_samples=100)
    write_plan(tmp_path / "plan.toml", shard_bytes="1MB")
    report, out = _modules_after(tmp_path, "split", tmp_path / "src", "--plan", tmp_path / "plan.toml", "--out", tmp_path / "out", "--json")
    assert report["exit"] in (0, None), report
    doc = json.loads(out)
    assert doc["cluster"] == "threads" and doc["samples_in"] == 300 and doc["cluster_seconds"] < 1.0  # no cluster to start
    assert {"dask", "dask.threaded"} <= set(report["loaded"])  # the tasks ran on Dask's scheduler...
    assert not set(report["loaded"]) & {*_HEAVY, *_OTHER_COMMANDS}, report  # ...with none of these imported
    regions, checked = verify_split(tmp_path / "out", "sha256")
    assert checked.ok and sum(r.samples for r in regions.values()) == 300
    # The same script does see distributed where the split uses it: the check can fail.
    report, _ = _modules_after(
        tmp_path, "split", tmp_path / "src", "--plan", tmp_path / "plan.toml", "--out", tmp_path / "p", "--processes"
    )
    assert report["exit"] in (0, None) and "distributed" in report["loaded"], report


def test_help_lists_every_command_and_a_lazily_imported_one_names_its_variables(tmp_path: Path) -> None:
    from geoshard.cli.app import LAZY_COMMANDS

    r = geoshard("--help", cwd=tmp_path)
    assert r.rc == 0, r.err
    listed = {line.split()[0] for line in r.out.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == {"demo", "inspect", "split", "synth", "verify", *LAZY_COMMANDS}
    r = geoshard("pull", "--help", cwd=tmp_path)
    assert r.rc == 0 and "GEOSHARD_PULL_PLAN" in r.out and "GEOSHARD_PULL_REGION" in r.out, r.out
    r = geoshard("wan", "check", "--help", cwd=tmp_path)
    assert r.rc == 0 and "GEOSHARD_WAN_CHECK_" in r.out, r.out


def test_progress_on_threads_counts_every_byte_once_from_the_task_threads_one_call_at_a_time(tmp_path: Path) -> None:
    from geoshard.plan import load_plan
    from geoshard.split import SplitSettings, run_split

    sources = make_corpus(tmp_path / "src", samples=3000, sample_bytes=5_000, shard_samples=500)  # 6 sources, several groups
    plan = write_plan(tmp_path / "plan.toml", shard_bytes="1MB")
    events: list[tuple[str, dict[str, int]]] = []
    busy, overlaps = threading.Lock(), []

    def progress(event: dict[str, int]) -> None:
        if not busy.acquire(blocking=False):
            overlaps.append(event)  # another thread is inside the callback
            return
        try:
            time.sleep(0.002)  # long enough for a concurrent call to find it busy
            events.append((threading.current_thread().name, dict(event)))
        finally:
            busy.release()

    result = run_split([str(tmp_path / "src")], load_plan(plan), SplitSettings(out=tmp_path / "out", workers=2), progress)
    assert result.cluster == "threads" and overlaps == []
    size = sum(p.stat().st_size for p in sources)
    assert events[0] == ("MainThread", {"total_bytes": size})
    assert sum(e.get("bytes", 0) for _, e in events) == size and sum(e.get("samples", 0) for _, e in events) == 3000
    shards = sum(r.shards for r in result.manifest.regions.values())
    assert sum(e.get("shards", 0) for _, e in events) == shards > 6
    senders = {name for name, e in events if "samples" in e}
    assert senders and all(n.startswith("geoshard-split") for n in senders), senders  # from the tasks, as they run
    assert {name for name, e in events if "shards" in e} == {"MainThread"}


def test_ctrl_c_stops_a_threaded_split_quickly_and_publishes_nothing(tmp_path: Path) -> None:
    make_corpus(tmp_path / "src", samples=600, sample_bytes=100_000, shard_samples=100)  # 60 MB in 6 sources
    write_plan(tmp_path / "plan.toml", shard_bytes="4MB")
    out = tmp_path / "out"
    argv = [GEOSHARD, "split", str(tmp_path / "src"), "--plan", str(tmp_path / "plan.toml"), "--out", str(out), "--workers", "1"]
    # Ctrl-C in a terminal reaches a process whose SIGINT is at its default. A test run started as a
    # shell's background job (``make test &``) has SIGINT ignored, which its children inherit, and a
    # Python started so keeps ignoring it: the split then finished and exited 0.
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    # the first shard file of the run (being written or done): early in the run, while a glob for
    # ``*.partial`` alone could miss the short windows of the first shards and fire during publishing
    while not list(out.glob(".geoshard-tmp/run-*/*/*")):
        assert p.poll() is None and time.monotonic() < deadline, "the split ended before a task was seen"
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    t = time.monotonic()
    stdout, stderr = p.communicate(timeout=60)
    assert time.monotonic() - t < 15, "Ctrl-C took long to stop the split"
    assert p.returncode == 1 and stderr.strip() == "Aborted!" and stdout == "", (p.returncode, stderr[-3000:], stdout[-500:])
    assert published(out) == [] and not (out / ".geoshard-tmp").exists()  # every task stopped before the cleanup
    r = _cli_split(tmp_path, tmp_path / "src", "out")  # the lock is free and a rerun publishes everything
    assert r.rc == 0 and json.loads(r.out)["samples_in"] == 600, r.err[-3000:]


def _slot_table_as_before(names: tuple[str, ...], weights: tuple[float, ...]) -> bytes:
    """The slot table as geoshard computed it before it was sped up: one Python loop over every
    (region, slot), strict ">" over regions in order. Splits made then must route the same."""
    best = [-1.0] * NSLOTS
    table = bytearray(NSLOTS)
    for idx, (name, weight) in enumerate(zip(names, weights, strict=True)):
        for block in range(NSLOTS // 8):
            digest = hashlib.blake2b(b"%s:%d" % (name.encode(), block), digest_size=64).digest()
            for j in range(8):
                u = (int.from_bytes(digest[8 * j : 8 * j + 8], "little") + 0.5) / 2.0**64
                score = weight / -math.log(u)
                if score > best[block * 8 + j]:
                    best[block * 8 + j] = score
                    table[block * 8 + j] = idx
    return bytes(table)


@pytest.mark.parametrize(
    ("names", "weights"),
    [
        (("us-east-1", "eu-west-1", "ap-southeast-1"), (2, 1, 1)),
        (("a", "b"), (1, 1)),
        (("solo",), (3.5,)),
        (("a", "b", "c", "d"), (0.1, 1e6, 3, 3)),
        (("same", "same"), (1, 1)),  # equal scores everywhere: the first region wins every tie
    ],
)
def test_slot_table_routes_exactly_as_before(names: tuple[str, ...], weights: tuple[float, ...]) -> None:
    table = slot_table(names, weights)
    assert table == _slot_table_as_before(names, weights)
    assert len(table) == NSLOTS and set(table) <= set(range(len(names)))
    if names == ("same", "same"):
        assert set(table) == {0}


def test_gzip_sources_split_through_the_reused_window(tmp_path: Path) -> None:
    """``.tar.gz`` sources reach the window through ``GzipFile.readinto``: every sample once, byte for byte."""
    plain = make_corpus(tmp_path / "plain", samples=120, sample_bytes=300_000, shard_samples=60)
    (tmp_path / "src").mkdir()
    for p in plain:
        (tmp_path / "src" / (p.name + ".gz")).write_bytes(gzip.compress(p.read_bytes(), compresslevel=1))
    write_plan(tmp_path / "plan.toml", shard_bytes="2MB")
    r = _cli_split(tmp_path, tmp_path / "src", "out")
    assert r.rc == 0 and r.err == "", r.err[-3000:]
    doc = json.loads(r.out)
    assert doc["cluster"] == "threads" and doc["samples_in"] == 120
    written = read_corpus([p for paths in region_shards(tmp_path / "out").values() for p in paths], "wds")
    assert written == read_corpus(plain, "wds") and sum(written.values()) == 120
    assert verify_split(tmp_path / "out", "sha256")[1].ok
