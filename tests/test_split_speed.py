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
import tarfile
from pathlib import Path

import pytest
from guaranteekit import assert_one_line, geoshard, published
from splitkit import make_corpus, read_corpus, region_shards, tree_digest, write_plan

from geoshard.formats import wds
from geoshard.formats._window import ReusedWindow, Window
from geoshard.routing import NSLOTS, slot_table
from geoshard.verify import verify_split


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


@pytest.mark.parametrize("kind", ["--threads", "--processes"])
def test_bad_input_is_one_line_on_both_in_process_clusters(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "src"
    make_corpus(src, samples=400, shard_samples=200)
    tars = sorted(src.glob("*.tar"))
    tars[1].write_bytes(tars[0].read_bytes())  # the same keys in two sources: found across groups
    (src / "z-cut.tar").write_bytes(tars[0].read_bytes()[:-3000])  # and a tar cut inside a member
    write_plan(tmp_path / "plan.toml", shard_bytes="64KB")
    r = _cli_split(tmp_path, src, "out", kind)
    assert_one_line(r, 1, "z-cut.tar: truncated tar at byte")
    assert r.out == "" and published(tmp_path / "out") == []
    (src / "z-cut.tar").unlink()
    r = _cli_split(tmp_path, src, "out", kind)
    assert_one_line(r, 1, "duplicate sample key", str(tars[0]), str(tars[1]))
    assert r.out == "" and published(tmp_path / "out") == []


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
