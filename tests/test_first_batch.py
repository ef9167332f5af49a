"""Issue 12 part 4: chunk hashes in the manifest, shards read by chunks, a first shuffle window of
one batch, and one fetch order per rank shared by its workers.

Real splits (``geoshard split``), real SeaweedFS buckets, real forked DataLoader workers."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from guaranteekit import geoshard
from servers import SeaweedS3
from splitkit import make_corpus
from synckit import cli, objects

from geoshard.errors import DataError
from geoshard.loaders import AllTiersFailed, ChainSettings, RegionalDataset, make_loader
from geoshard.loaders.epoch import Layout, need_positions, rank_plan, windows
from geoshard.loaders.fetchqueue import FetchQueue
from geoshard.loaders.pieces import Piece, rank_order
from geoshard.loaders.shard import Shard
from geoshard.manifest import MANIFEST, parse_region_manifest, read_region_manifest
from geoshard.split.task import CHUNK_BYTES

EU = "eu-west-1"
GEOSHARD = str(Path(sys.executable).with_name("geoshard"))


@pytest.fixture(scope="module")
def region(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One region's split with shards of up to 4 MB (chunks of ~1 MiB) of ~5.6 KB samples."""
    tmp = tmp_path_factory.mktemp("chunks")
    make_corpus(tmp / "corpus", samples=4000, sample_bytes=3000, shard_samples=1000)
    (tmp / "plan.toml").write_text(f'[shards]\nbytes = "4MB"\n[regions.{EU}]\nweight = 1\n')
    r = cli("split", tmp / "corpus", "--plan", tmp / "plan.toml", "--out", tmp / "split", "--workers", "1")
    assert r.exit_code == 0, r.output
    return tmp / "split" / EU


def _bucket(server: SeaweedS3, tag: str, folder: Path, manifest: bytes | None = None, damage: dict[str, int] | None = None) -> str:
    """A new bucket holding ``folder`` under ``train/`` (optionally another manifest, and shards
    with one byte flipped at the given offsets)."""
    bucket = f"{tag}-{time.time_ns() % 10**9}"
    server.make_bucket(bucket)
    with contextlib.closing(server.client()) as c:
        for f in folder.iterdir():
            body = f.read_bytes()
            if f.name == MANIFEST and manifest is not None:
                body = manifest
            if damage and f.name in damage:
                b = bytearray(body)
                b[damage[f.name]] ^= 0xFF
                body = bytes(b)
            c.put_object(Bucket=bucket, Key=f"train/{f.name}", Body=body)
    return bucket


def _plan(path: Path, server: SeaweedS3, bucket: str) -> Path:
    """The split's plan (``region``'s shard size) with a bucket: sync refuses a plan the split was not made with."""
    region = f'[regions.{EU}]\nweight = 1\nbucket = "s3://{bucket}/train"\nendpoint = "{server.endpoint}"\n'
    path.write_text('[shards]\nbytes = "4MB"\n' + region)
    return path


def _without_chunks(folder: Path) -> bytes:
    d = json.loads((folder / MANIFEST).read_bytes())
    for s in d["shards"]:
        del s["chunks"]
    return (json.dumps(d, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _keys(loader: Any) -> list[str]:
    return [k for batch in loader for k in batch["__key__"]]


# -- the manifest -------------------------------------------------------------------------------


def test_split_writes_chunk_hashes_of_runs_of_whole_samples(region: Path) -> None:
    m = read_region_manifest(region)
    assert m.samples == 4000 and max(len(s.chunks.bytes) for s in m.shards if s.chunks) >= 3
    for s in m.shards:
        data = (region / s.path).read_bytes()
        c = s.chunks
        assert c is not None and c.size == CHUNK_BYTES
        assert sum(c.bytes) == s.bytes == len(data) and sum(c.samples) == s.samples
        pos = 0
        for i, (n, samples, h) in enumerate(zip(c.bytes, c.samples, c.xxh3_128, strict=True)):
            part = data[pos : pos + n]
            assert xxhash.xxh3_128(part).hexdigest() == h
            # A chunk is whole samples: it parses alone (with end blocks) into exactly its samples.
            alone = Shard(s.path, part if i == len(c.bytes) - 1 else part + bytes(1024), "wds")
            assert len(alone) == samples
            if i < len(c.bytes) - 1:  # cut at the first sample boundary past the size
                assert CHUNK_BYTES <= n < CHUNK_BYTES + 16384
            pos += n


def test_manifests_with_and_without_chunks_read_and_round_trip_byte_identical(region: Path) -> None:
    raw = (region / MANIFEST).read_bytes()
    assert parse_region_manifest(raw, "m").to_json() == raw
    old = _without_chunks(region)
    parsed = parse_region_manifest(old, "old")
    assert all(s.chunks is None for s in parsed.shards) and parsed.to_json() == old


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda c: c["xxh3_128"].pop(), "same number of chunks"),
        (lambda c: c["bytes"].__setitem__(0, c["bytes"][0] + 1), "add up to the shard's"),
        (lambda c: c["xxh3_128"].__setitem__(1, "z" * 32), "32 lowercase hex"),
        (lambda c: c.pop("samples"), "'samples'"),
    ],
)
def test_a_bad_chunks_field_is_one_line_naming_the_shard(region: Path, change: Any, says: str) -> None:
    d = json.loads((region / MANIFEST).read_bytes())
    change(d["shards"][1]["chunks"])
    with pytest.raises(DataError) as e:
        parse_region_manifest(json.dumps(d).encode(), "eu/manifest.json")
    msg = str(e.value)
    assert d["shards"][1]["path"] in msg and says in msg and "\n" not in msg


def test_geoshard_verify_reports_a_bad_chunks_field_in_one_line(region: Path, tmp_path: Path) -> None:
    copy = tmp_path / EU
    copy.mkdir()
    for f in region.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    d = json.loads((copy / MANIFEST).read_bytes())
    d["shards"][0]["chunks"]["samples"][0] += 1
    (copy / MANIFEST).write_text(json.dumps(d))
    r = subprocess.run([GEOSHARD, "verify", str(copy)], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and d["shards"][0]["path"] in lines[0] and "chunks" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_sync_carries_the_chunk_hashes_unchanged(region: Path, tmp_path: Path, aws: SeaweedS3) -> None:
    bucket = f"gs-sync-{time.time_ns() % 10**9}"
    aws.make_bucket(bucket)
    r = geoshard("sync", region.parent, "--plan", _plan(tmp_path / "p.toml", aws, bucket), "--json", cwd=tmp_path, timeout=120)
    assert r.rc == 0 and r.err == "", r.err[-3000:]
    shards = len(json.loads((region / MANIFEST).read_bytes())["shards"])
    report = json.loads(r.out)
    assert report["ok"] and list(report["regions"]) == [EU], r.out
    done = report["regions"][EU]
    assert done["published"] and done["failed"] == 0 and done["uploaded"] == shards, (shards, done)
    got = objects(aws, bucket)["train/manifest.json"]
    assert got == (region / MANIFEST).read_bytes() and b'"chunks"' in got


# -- the epoch plan -----------------------------------------------------------------------------


def test_first_shuffle_window_is_one_batch_and_grows_by_a_quarter_up_to_the_buffer() -> None:
    layout = Layout(batch_size=128, shuffle_buffer=1000, seed=3)
    bounds = windows(9000, layout)
    sizes = np.diff(bounds).tolist()
    assert sizes[:11] == [128, 160, 200, 250, 312, 390, 487, 608, 760, 950, 1000] and set(sizes[11:-1]) == {1000}
    need = need_positions(9000, layout)
    assert need[:128].tolist() == [0] * 128 and need[128] == 128 and need[287] == 128 and need[288] == 288
    plan = rank_plan([9000], 0, layout)
    _, idx = plan.worker_stream(0, layout, 0)
    assert sorted(idx[:128].tolist()) == list(range(128)), "the first batch comes from the first batch's samples"
    assert sorted(idx[128:288].tolist()) == list(range(128, 288))
    assert idx[:128].tolist() != list(range(128)), "and is shuffled within them"
    assert sorted(idx.tolist()) == list(range(9000))
    assert need_positions(10, Layout(shuffle=False)).tolist() == list(range(10))


def test_rank_order_interleaves_workers_by_the_batch_that_needs_them() -> None:
    def p(need: int) -> Piece:
        return Piece(0, 0, 0, True, need, 0, 0, 10)

    # The first round (each worker's first batch) last worker first; then batch by batch, worker 0 first.
    w0, w1 = [p(0), p(0), p(32), p(96)], [p(0), p(64)]
    assert rank_order([w0, w1], 32, 0) == [[1, 2, 3, 5], [0, 4]]
    assert rank_order([w0, w1], 32, 1) == [[0, 1, 3, 5], [2, 4]], "after a resume worker 1 plays first: its first batch is fetched last"


# -- the fetch queue ----------------------------------------------------------------------------


def _take(queue: FetchQueue, pieces: list[int], out: Any) -> None:
    stop = threading.Event()
    for g in pieces:
        queue.wait_turn(g, stop)
        t0 = time.monotonic()
        time.sleep(0.05)
        queue.arrived(g, 50)
        time.sleep(0.05)
        queue.done(g)
        out.put((g, t0, time.monotonic()))


def test_forked_workers_take_their_turns_in_the_ranks_order() -> None:
    queue = FetchQueue([100] * 6, lead_bytes=50)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    # Worker 1 holds pieces 0, 2, 4, worker 0 pieces 1, 3, 5: each waits for the other's.
    procs = [ctx.Process(target=_take, args=(queue, [1, 3, 5], out)), ctx.Process(target=_take, args=(queue, [0, 2, 4], out))]
    for pr in procs:
        pr.start()
    got = sorted(out.get(timeout=30) for _ in range(6))
    for pr in procs:
        pr.join(10)
    starts, ends = [g[1] for g in got], [g[2] for g in got]
    for g in range(1, 6):
        # A piece starts once the one before has no more than lead_bytes left: halfway, not before.
        assert starts[g] >= starts[g - 1] + 0.045, got
        assert starts[g] < ends[g - 1], "the next request overlaps the end of the previous one"
    assert queue.pending() == 0


def test_a_queue_that_did_not_travel_by_fork_never_blocks() -> None:
    import pickle

    q = pickle.loads(pickle.dumps(FetchQueue([100, 100])))  # noqa: S301 - our own bytes, just pickled
    assert not q.usable and q.wait_turn(1, threading.Event())


# -- the loader ---------------------------------------------------------------------------------


def test_chunk_reads_yield_the_same_samples_in_the_same_order_as_whole_shards(region: Path, tmp_path: Path, aws: SeaweedS3) -> None:
    chunked = _plan(tmp_path / "chunked.toml", aws, _bucket(aws, "gs-ch", region))
    whole = _plan(tmp_path / "whole.toml", aws, _bucket(aws, "gs-wh", region, manifest=_without_chunks(region)))

    def loader(plan: Path) -> Any:
        return make_loader(plan, region=EU, batch_size=64, num_workers=2, seed=7, shuffle_buffer=300, allow_cross_region=False)

    a, b = loader(chunked), loader(whole)
    got, want = _keys(a), _keys(b)
    assert got == want and len(set(got)) == 4000
    sa, sb = a.stats()["tiers"][f"s3:{EU}"], b.stats()["tiers"][f"s3:{EU}"]
    # Whole shards: each worker reads its shards (a boundary shard twice). By chunks: more, smaller
    # requests, and of a shard only the chunks the worker uses (the boundary chunk twice).
    shards = read_region_manifest(region).shards
    assert sb["hits"] <= len(shards) + 1 and sa["hits"] > sb["hits"] and sa["verify_failures"] == 0
    total = sum(s.bytes for s in shards)
    assert total <= sa["bytes"] <= total + max(max(s.chunks.bytes) for s in shards if s.chunks) < sb["bytes"]
    # The same in one process, without workers.
    ds_a = RegionalDataset(chunked, region=EU, seed=7, shuffle_buffer=300, allow_cross_region=False)
    ds_b = RegionalDataset(whole, region=EU, seed=7, shuffle_buffer=300, allow_cross_region=False)
    assert [s["__key__"] for s in ds_a] == [s["__key__"] for s in ds_b]


def test_resume_with_chunk_reads_is_exact(region: Path, tmp_path: Path, aws: SeaweedS3) -> None:
    plan = _plan(tmp_path / "p.toml", aws, _bucket(aws, "gs-res", region))

    def loader() -> Any:
        return make_loader(plan, region=EU, batch_size=64, num_workers=2, seed=2, shuffle_buffer=500, allow_cross_region=False)

    full = [b["__key__"] for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)["__key__"] for _ in range(13)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    rest = [b["__key__"] for b in again]
    assert head + rest == full


@pytest.mark.parametrize("where", ["middle", "last"])
def test_a_damaged_chunk_fails_in_one_line_naming_shard_and_chunk(region: Path, tmp_path: Path, aws: SeaweedS3, where: str) -> None:
    shard = read_region_manifest(region).shards[2]
    assert shard.chunks is not None
    n = len(shard.chunks.bytes)
    chunk = 1 if where == "middle" else n - 1
    offset = sum(shard.chunks.bytes[:chunk]) + shard.chunks.bytes[chunk] // 2
    plan = _plan(tmp_path / "p.toml", aws, _bucket(aws, "gs-dmg", region, damage={shard.path: offset}))
    settings = ChainSettings(timeouts=(("s3", 5.0),))
    loader = make_loader(plan, region=EU, batch_size=64, num_workers=2, seed=1, allow_cross_region=False, settings=settings)
    with pytest.raises(AllTiersFailed) as e:
        _keys(loader)
    msg = str(e.value)
    assert f"{shard.path} chunk {chunk} " in msg and "does not match its manifest's xxh3_128" in msg and "\n" not in msg, msg
    # Whole shards (an older manifest) fail as before, naming the shard.
    whole = _plan(tmp_path / "w.toml", aws, _bucket(aws, "gs-dmw", region, manifest=_without_chunks(region), damage={shard.path: offset}))
    with pytest.raises(AllTiersFailed, match=f"shard {shard.path} .*does not match its manifest"):
        _keys(make_loader(whole, region=EU, batch_size=64, num_workers=2, seed=1, allow_cross_region=False, settings=settings))


def test_a_local_replica_with_a_damaged_chunk_falls_back_to_the_bucket(region: Path, tmp_path: Path, aws: SeaweedS3) -> None:
    bucket = _bucket(aws, "gs-loc", region)
    local = tmp_path / "replica"
    local.mkdir()
    for f in region.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    victim = read_region_manifest(region).shards[1].path
    data = bytearray((local / victim).read_bytes())
    data[len(data) // 2] ^= 1
    (local / victim).write_bytes(bytes(data))
    plan = tmp_path / "p.toml"
    plan.write_text(f'[regions.{EU}]\nweight = 1\nlocal = "{local}"\nbucket = "s3://{bucket}/train"\nendpoint = "{aws.endpoint}"\n')
    # Without write-back a shard is read by chunks from the replica too (mapped, checked per chunk).
    ds = RegionalDataset(plan, region=EU, seed=0, settings=ChainSettings(writeback=False), allow_cross_region=False)
    assert len({s["__key__"] for s in ds}) == 4000
    t = ds.stats()["tiers"]
    assert t[f"local:{EU}"]["verify_failures"] == 1 and t[f"s3:{EU}"]["hits"] >= 1
    assert not (local / victim).exists(), "the corrupt local copy is removed"


def test_the_first_piece_is_the_first_batchs_chunk(region: Path) -> None:
    ds = RegionalDataset(_local_plan(region), region=EU, seed=0, batch_size=64, settings=ChainSettings(writeback=False))
    start = ds.begin(2)
    rp = ds.rank_pieces(start)
    per_worker, places = rp.workers, rp.places
    first = [wp.pieces[0] for wp in per_worker]
    assert all(p.chunked and p.last - p.first <= 1 for p in first), first
    assert all(p.length < 2.1 * CHUNK_BYTES for p in first)
    # The first round before any read-ahead, worker 1's first (it is needed one step after worker 0's).
    firsts = [g for w in (0, 1) for g, p in zip(places[w], per_worker[w].pieces, strict=True) if p.need < 64]
    assert sorted(firsts) == list(range(len(firsts))) and places[1][0] == 0
    lengths = sorted(p.length for wp in per_worker for p in wp.pieces)
    assert np.sum(lengths) >= sum(s.bytes for s in ds.manifest.shards) - 2 * CHUNK_BYTES


def _local_plan(region: Path) -> Path:
    plan = region.parent.parent / "local.toml"
    plan.write_text(f'[regions.{EU}]\nweight = 1\nlocal = "{region}"\n')
    return plan


def test_no_traceback_or_leftover_process_when_the_consumer_stops_early(region: Path, tmp_path: Path, aws: SeaweedS3) -> None:
    plan = _plan(tmp_path / "p.toml", aws, _bucket(aws, "gs-stop", region))
    loader = make_loader(plan, region=EU, batch_size=64, num_workers=2, seed=3, allow_cross_region=False)
    t0 = time.monotonic()
    it = iter(loader)
    next(it)
    del it  # workers shut down; fetches waiting for their turn give up
    deadline = time.monotonic() + 20
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children() and time.monotonic() - t0 < 30


def test_the_first_round_goes_at_once_and_the_rest_waits_its_turn() -> None:
    q = FetchQueue([100, 100, 100], lead_bytes=0, timeout_s=5, free=2)
    stop = threading.Event()
    t0 = time.monotonic()
    assert q.wait_turn(0, stop) and q.wait_turn(1, stop), "the first round: no waiting for each other"
    assert time.monotonic() - t0 < 0.5
    started = threading.Event()
    threading.Thread(target=lambda: (q.wait_turn(2, stop), started.set()), daemon=True).start()
    q.done(0)
    assert not started.wait(0.3), "piece 2 waits for the whole first round"
    q.done(1)
    assert started.wait(5)
