"""RegionalDataset and make_loader over real splits: contents, rank and worker splits with equal
counts, epochs, exact resume, decoding, write-back through SeaweedFS, and a clear failure when no
tier can serve a shard."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from servers import SeaweedS3, closed_port
from splitkit import REGIONS, make_corpus
from synckit import cli

from geoshard.errors import ConfigError, DataError
from geoshard.formats import tfrecord, wds
from geoshard.formats.example import parse_example
from geoshard.loaders import AllTiersFailed, ChainSettings, RegionalDataset, make_loader, timed
from geoshard.loaders.epoch import Layout, rank_plan
from geoshard.loaders.prefetch import Prefetcher
from geoshard.manifest import read_region_manifest
from geoshard.util.retry import Backoff

EU = "eu-west-1"


def write_plan(path: Path, out: Path) -> Path:
    lines = ['[shards]\nbytes = "40KB"']
    for r, w in zip(REGIONS, (2, 1, 1), strict=True):
        lines.append(f'[regions.{r}]\nweight = {w}\nlocal = "{out / r}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def split(tmp: Path, fmt: str = "wds", samples: int = 1500) -> Path:
    make_corpus(tmp / "corpus", fmt=fmt, samples=samples, sample_bytes=300, shard_samples=200)
    plan = write_plan(tmp / "plan.toml", tmp / "split")
    r = cli("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.exit_code == 0, r.output
    return plan


def region_samples(folder: Path, fmt: str) -> list[Any]:
    """The region's samples in manifest order, read with geoshard's own format readers."""
    out: list[Any] = []
    for s in read_region_manifest(folder).shards:
        with open(folder / s.path, "rb") as f:
            if fmt == "wds":
                out += [{"__key__": k.decode(), **wds.sample_fields(m)} for k, m in wds.iter_samples(f, s.path)]
            else:
                out += list(tfrecord.iter_records(f, s.path))
    return out


def upload_region(server: SeaweedS3, tag: str, folder: Path) -> str:
    """A new bucket holding a region's folder (manifest and shards) under ``train/``; its name."""
    bucket = f"{tag}-{time.time_ns() % 10**9}"
    server.make_bucket(bucket)
    with contextlib.closing(server.client()) as c:
        for f in folder.iterdir():
            c.put_object(Bucket=bucket, Key=f"train/{f.name}", Body=f.read_bytes())
    return bucket


@pytest.fixture(scope="module")
def wds_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split(tmp_path_factory.mktemp("wds"))


def keys(items: list[Any]) -> list[str]:
    return [x["__key__"] for x in items]


def test_minimal_call_yields_every_sample_of_the_region_as_bytes(wds_plan: Path) -> None:
    ds = RegionalDataset(wds_plan, region=EU, shuffle=False, seed=0)
    got = list(ds)
    want = region_samples(wds_plan.parent / "split" / EU, "wds")
    assert got == want and len(got) == len(ds) > 100
    assert set(got[0]) == {"__key__", "img", "cls", "json"} and all(isinstance(v, bytes) for k, v in got[0].items() if k != "__key__")
    snap = ds.stats()
    assert snap["tiers"][f"local:{EU}"]["hits"] == len(read_region_manifest(wds_plan.parent / "split" / EU).shards)
    assert snap["dropped_samples"] == 0


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_equal_disjoint_shares_and_the_remainder_is_reported(wds_plan: Path, world: int) -> None:
    total = len(region_samples(wds_plan.parent / "split" / EU, "wds"))
    shares = [keys(list(RegionalDataset(wds_plan, region=EU, seed=3, rank=r, world_size=world))) for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    flat = [k for s in shares for k in s]
    assert len(set(flat)) == len(flat) == total - total % world
    assert RegionalDataset(wds_plan, region=EU, rank=0, world_size=world).stats()["dropped_samples"] == total % world
    padded = [keys(list(RegionalDataset(wds_plan, region=EU, seed=3, rank=r, world_size=world, remainder="pad"))) for r in range(world)]
    assert len({len(s) for s in padded}) == 1 and len({k for s in padded for k in s}) == total


def test_epoch_plan_balances_ranks_workers_and_batches_for_any_shard_sizes() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        counts = rng.integers(0, 60, size=int(rng.integers(1, 12))).tolist()
        world, workers, bs = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
        batches, seen = set(), Counter[tuple[int, int]]()
        for rank in range(world):
            layout = Layout(rank=rank, world_size=world, num_workers=workers, batch_size=bs, seed=1, shuffle_buffer=7)
            plan = rank_plan(counts, 2, layout)
            assert len(plan) == sum(counts) // world and plan.dropped == sum(counts) % world
            n = 0
            for w in range(workers):
                sh, ix = plan.worker_stream(w, layout, 2)
                n += -(-len(sh) // bs)
                seen.update(zip(sh.tolist(), ix.tolist(), strict=True))
                assert all(0 <= i < counts[s] for s, i in zip(sh.tolist(), ix.tolist(), strict=True))
            batches.add(n)
        assert len(batches) == 1, "ranks must yield the same number of batches"
        assert max(seen.values(), default=1) == 1 and sum(seen.values()) == sum(counts) - sum(counts) % world


def test_epochs_reshuffle_deterministically(wds_plan: Path) -> None:
    def order(seed: int, epoch: int) -> list[str]:
        ds = RegionalDataset(wds_plan, region=EU, seed=seed, shuffle_buffer=100)
        ds.set_epoch(epoch)
        return keys(list(ds))

    e0, e1 = order(0, 0), order(0, 1)
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert order(0, 1) == e1 and order(7, 1) != e1


def test_resume_mid_epoch_in_one_process_yields_exactly_the_rest(wds_plan: Path) -> None:
    ds = RegionalDataset(wds_plan, region=EU, seed=5, shuffle_buffer=64)
    ds.set_epoch(1)
    full = keys(list(ds))
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(137)]
    state = json.loads(json.dumps(ds.state_dict()))  # plain data: it goes into checkpoints
    fresh = RegionalDataset(wds_plan, region=EU, seed=5, shuffle_buffer=64)
    fresh.load_state_dict(state)
    assert fresh.epoch == 1
    assert head + keys(list(fresh)) == full


def test_loader_batches_in_workers_and_resumes_in_the_original_order(wds_plan: Path) -> None:
    def loader() -> Any:
        return make_loader(wds_plan, region=EU, batch_size=16, num_workers=2, seed=2, shuffle_buffer=50)

    first = loader()
    first.set_epoch(3)
    full = [b["__key__"] for b in first]
    assert len(full) == len(first) and sum(map(len, full)) == len(region_samples(wds_plan.parent / "split" / EU, "wds"))
    assert first.stats()["tiers"][f"local:{EU}"]["hits"] >= len(read_region_manifest(wds_plan.parent / "split" / EU).shards)
    for stop in (5, 6):  # an odd and an even number of batches: the worker rotation matters
        run = loader()
        run.set_epoch(3)
        it = iter(run)
        head = [next(it)["__key__"] for _ in range(stop)]
        state = run.state_dict()
        del it
        resumed = loader()
        resumed.load_state_dict(state)
        assert head + [b["__key__"] for b in resumed] == full
    with pytest.raises(ConfigError, match="same number"):
        other = make_loader(wds_plan, region=EU, batch_size=16, num_workers=1, seed=2, shuffle_buffer=50)
        other.load_state_dict(state)
        next(iter(other))


def test_state_from_another_layout_is_refused(wds_plan: Path) -> None:
    state = RegionalDataset(wds_plan, region=EU, seed=1).state_dict()
    with pytest.raises(ConfigError, match="seed is 1 there, 2 here"):
        RegionalDataset(wds_plan, region=EU, seed=2).load_state_dict(state)


def test_region_from_the_environment_or_a_clear_error(wds_plan: Path) -> None:
    assert RegionalDataset(wds_plan, environ={"GEOSHARD_REGION": EU, "AWS_REGION": "us-east-1"}).region == EU
    assert RegionalDataset(wds_plan, environ={"AWS_DEFAULT_REGION": EU}).region == EU
    with pytest.raises(ConfigError, match="no region"):
        RegionalDataset(wds_plan, environ={})
    with pytest.raises(ConfigError, match="unknown region 'mars-1'"):
        RegionalDataset(wds_plan, region="mars-1")


def test_decoders_callable_and_webdataset_handlers(wds_plan: Path) -> None:
    import webdataset.autodecode as ad

    ds = RegionalDataset(wds_plan, region=EU, shuffle=False, decode=[ad.basichandlers])
    first = next(iter(ds))
    assert isinstance(first["cls"], int) and isinstance(first["json"], dict)
    sizes = list(RegionalDataset(wds_plan, region=EU, shuffle=False, decode=lambda s: len(s["img"])))
    assert sizes == [len(s["img"]) for s in region_samples(wds_plan.parent / "split" / EU, "wds")]
    with pytest.raises(ConfigError, match="TFRecord"):
        RegionalDataset(wds_plan, region=EU, decode="example")


def test_tfrecord_records_as_bytes_and_parsed_examples(tmp_path: Path) -> None:
    plan = split(tmp_path, fmt="tfrecord", samples=600)
    want = region_samples(tmp_path / "split" / EU, "tfrecord")
    assert list(RegionalDataset(plan, region=EU, shuffle=False)) == want
    parsed = list(RegionalDataset(plan, region=EU, shuffle=False, decode="example"))
    assert len(parsed) == len(want)
    ref = parse_example(want[0])
    for name, value in ref.items():
        got = parsed[0][name]
        if isinstance(value[0], bytes):
            assert got == value
        else:
            assert got.tolist() == pytest.approx(value)
    batch = next(iter(make_loader(plan, region=EU, batch_size=8, num_workers=0, shuffle=False, decode="example")))
    label = next(k for k, v in ref.items() if isinstance(v[0], int))
    assert batch[label].shape[0] == 8


def test_prefetch_keeps_at_most_depth_shards_in_flight() -> None:
    in_flight, peak = 0, 0

    def fetch(s: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        time.sleep(0.01)
        in_flight -= 1
        return s * 10

    p: Prefetcher[int] = Prefetcher(fetch, list(range(20)), depth=3)
    submitted = []
    for s in range(20):
        assert p.get(s) == s * 10
        submitted.append(p._submitted)
    p.close()
    assert peak <= 3 and max(b - a for a, b in enumerate(submitted)) <= 4


def test_write_back_fills_the_local_replica_and_the_second_epoch_reads_it(tmp_path: Path, aws: SeaweedS3) -> None:
    plan = split(tmp_path, samples=800)
    folder = tmp_path / "split" / EU
    bucket = upload_region(aws, "gs-wb", folder)
    cache = tmp_path / "replica"
    text = plan.read_text().replace(
        f'local = "{folder}"', f'local = "{cache}"\nbucket = "s3://{bucket}/train"\nendpoint = "{aws.endpoint}"'
    )
    plan.write_text(text)
    ds = RegionalDataset(plan, region=EU, seed=0, allow_cross_region=False)
    shards = read_region_manifest(folder).shards
    first = keys(list(ds))
    snap = ds.stats()["tiers"]
    assert snap[f"s3:{EU}"]["hits"] == len(shards) and snap.get(f"local:{EU}", {}).get("hits", 0) == 0
    assert sorted(p.name for p in cache.iterdir()) == sorted(s.path for s in shards)
    ds.set_epoch(1)
    second = keys(list(ds))
    snap = ds.stats()["tiers"]
    assert sorted(first) == sorted(second)
    assert snap[f"local:{EU}"]["hits"] == len(shards) and snap[f"s3:{EU}"]["hits"] == len(shards)


def test_no_tier_can_serve_a_shard_fails_clearly_and_promptly(tmp_path: Path) -> None:
    plan = split(tmp_path, samples=400)
    folder = tmp_path / "split" / EU
    victim = read_region_manifest(folder).shards[0].path
    settings = ChainSettings(timeouts=(("s3", 0.5),), backoff=Backoff(attempts=1, base=0.01, jitter=0))
    text = plan.read_text().replace(
        f'local = "{folder}"', f'local = "{folder}"\nbucket = "s3://nowhere/train"\nendpoint = "http://127.0.0.1:{closed_port()}"'
    )
    plan.write_text(text)
    ds = RegionalDataset(plan, region=EU, shuffle=False, settings=settings)  # the manifest comes from the local replica
    (folder / victim).write_bytes(b"corrupt")
    t0 = time.monotonic()
    with pytest.raises(AllTiersFailed) as e:
        list(ds)
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    assert victim in msg and f"local:{EU}" in msg and f"s3:{EU}" in msg and "\n" not in msg
    assert not (folder / victim).exists(), "a corrupt local copy is removed"


def test_loader_error_in_a_worker_reaches_the_training_loop(tmp_path: Path) -> None:
    plan = split(tmp_path, samples=400)
    folder = tmp_path / "split" / EU
    for s in read_region_manifest(folder).shards:
        (folder / s.path).unlink()
    loader = make_loader(plan, region=EU, batch_size=8, num_workers=2)
    with pytest.raises(AllTiersFailed, match="no tier could serve it"):
        list(loader)


def _worker_pid(samples: list[Any]) -> int:
    return os.getpid()


def test_a_stuck_worker_is_one_line_naming_the_rank_after_the_loaders_timeout(wds_plan: Path) -> None:
    """A worker that stops answering (SIGSTOP here; a deadlock in a user's) ends the iteration
    with one DataError after ``timeout``, not a wait without end."""
    loader = make_loader(wds_plan, region=EU, batch_size=8, num_workers=1, collate_fn=_worker_pid, timeout=1.5)
    it = iter(loader)
    worker = next(it)
    os.kill(worker, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(DataError) as e:
            for _ in it:  # the batches already queued, then the wait
                pass
        waited = time.monotonic() - t0
    finally:
        os.kill(worker, signal.SIGCONT)
        del it
    assert str(e.value).startswith(f"region {EU} rank 0: no batch from the loader's workers in 1.5 s"), e.value
    assert "\n" not in str(e.value) and 1.5 <= waited < 10, waited


def test_timed_measures_the_consumers_wait(wds_plan: Path) -> None:
    loader = make_loader(wds_plan, region=EU, batch_size=32, num_workers=0, seed=0)
    t = timed(loader)
    n = sum(len(b["__key__"]) for b in t)
    s = t.stats()
    assert s["batches"] == len(loader) and n == loader.dataset.samples_per_epoch
    assert 0 < s["wait_max_s"] <= s["wait_s"] <= s["time_to_first_batch_s"] + s["wait_after_first_s"] + 1e-9
    assert s["time_to_first_batch_s"] >= t.waits[0]
    assert s["loader"]["tiers"][f"local:{EU}"]["hits"] > 0


def test_the_package_exports_what_it_lists() -> None:
    import geoshard.loaders as pkg

    assert sorted(pkg.__all__) == sorted(pkg._WHERE)
    assert all(getattr(pkg, name) is not None for name in pkg.__all__)


def test_a_worker_error_reaches_the_loop_as_one_line(tmp_path: Path) -> None:
    plan = split(tmp_path, samples=300)
    folder = tmp_path / "split" / EU
    for s in read_region_manifest(folder).shards:
        (folder / s.path).unlink()
    with pytest.raises(AllTiersFailed) as e:
        list(make_loader(plan, region=EU, batch_size=8, num_workers=2))
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value) and str(e.value).startswith("shard ")


def test_stream_runs_epoch_after_epoch_and_resumes_inside_it(wds_plan: Path) -> None:
    def loader() -> Any:
        return make_loader(wds_plan, region=EU, batch_size=16, num_workers=2, seed=4, shuffle_buffer=50, lookahead=3)

    per_epoch = []
    for epoch in range(3):
        one = loader()
        one.set_epoch(epoch)
        per_epoch += [b["__key__"] for b in one]
    streamed = loader()
    it = streamed.stream()
    got = [next(it)["__key__"] for _ in range(len(per_epoch))]
    assert got == per_epoch and streamed.dataset.epoch == 2
    # Stop in the second epoch, inside the lookahead window of its end, and resume.
    run = loader()
    it = run.stream()
    stop = len(run) + len(run) - 2
    head = [next(it)["__key__"] for _ in range(stop)]
    state = run.state_dict()
    assert state["epoch"] == 1
    resumed = loader()
    resumed.load_state_dict(state)
    rest = resumed.stream()
    assert head + [next(rest)["__key__"] for _ in range(len(per_epoch) - stop)] == per_epoch


def test_workers_reading_s3_do_not_share_the_parents_connections(tmp_path: Path, aws: SeaweedS3) -> None:
    # The training process reads the manifest from the bucket (a pooled keep-alive connection);
    # forked workers that reused it would read each other's responses (wrong shards, caught by sha256).
    plan = split(tmp_path, samples=1500)
    folder = tmp_path / "split" / EU
    bucket = upload_region(aws, "gs-fork", folder)
    plan.write_text(plan.read_text().replace(f'local = "{folder}"', f'bucket = "s3://{bucket}/train"\nendpoint = "{aws.endpoint}"'))
    loader = make_loader(plan, region=EU, batch_size=8, num_workers=2, prefetch=3, allow_cross_region=False)
    want = sorted(keys(region_samples(folder, "wds")))
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sorted(k for b in loader for k in b["__key__"]) == want
    s3 = loader.stats()["tiers"][f"s3:{EU}"]
    assert s3["verify_failures"] == 0 and s3["errors"] == 0 and s3["hits"] >= 2 * len(read_region_manifest(folder).shards)
