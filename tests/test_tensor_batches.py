"""Tensor batches: fixed-size fields and labels decoded into one contiguous buffer per batch, which
crosses from forked workers through a shared slot pool (no pickled bytes, no segment per batch);
slots come back when the consumer drops the tensors, and a full pool falls back to pickling."""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import numpy as np
import pytest
import torch

from geoshard.errors import ConfigError, DataError
from geoshard.loaders.decode import Label, PackedBatch, Raw, TensorSpec, fill_batch, unpack
from geoshard.loaders.slots import SlotPool

SPEC = TensorSpec({"img": Raw((4, 5)), "cls": Label(), "f": Raw((3,), "float32")})


def _samples(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "__key__": f"k{i}",
            "img": memoryview(bytes([i % 256]) * 20),
            "cls": b"%d" % (i * 3),
            "f": np.array([i, i + 0.5, -i], dtype=np.float32).tobytes(),
        }
        for i in range(start, start + n)
    ]


def _check(batch: dict[str, Any], start: int, n: int) -> None:
    assert batch["img"].dtype == torch.uint8 and batch["img"].shape == (n, 4, 5)
    assert batch["cls"].dtype == torch.int64 and batch["cls"].tolist() == [i * 3 for i in range(start, start + n)]
    assert batch["f"].dtype == torch.float32 and batch["f"][:, 1].tolist() == [i + 0.5 for i in range(start, start + n)]
    assert [int(batch["img"][j, 3, 4]) for j in range(n)] == [i % 256 for i in range(start, start + n)]
    assert batch["__key__"] == [f"k{i}" for i in range(start, start + n)]


def test_fill_and_unpack_one_buffer() -> None:
    out = np.zeros(SPEC.batch_bytes(7), dtype=np.uint8)
    packed = fill_batch(SPEC, _samples(7), ["s.tar"] * 7, out)
    assert packed.nbytes == len(out) and [f[3] % 64 for f in packed.fields] == [0, 0, 0]  # cache-line aligned fields
    batch = unpack(packed, out)
    _check(batch, 0, 7)
    assert batch["img"].untyped_storage().data_ptr() == out.ctypes.data  # views of the one buffer, no copy


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"img": b"short"}, "s.tar: sample 'k2', field 'img': 5 bytes, the TensorSpec wants 20 (uint8 (4, 5))"),
        ({"cls": b"cat"}, "s.tar: sample 'k2', field 'cls': invalid literal"),
        ({"f": None}, "s.tar: sample 'k2' has no field 'f' (TensorSpec)"),
    ],
)
def test_bad_fields_name_shard_key_and_field(change: dict[str, Any], words: str) -> None:
    samples = _samples(4)
    for k, v in change.items():
        if v is None:
            del samples[2][k]
        else:
            samples[2][k] = v
    with pytest.raises(DataError) as e:
        fill_batch(SPEC, samples, ["s.tar"] * 4, np.zeros(SPEC.batch_bytes(4), dtype=np.uint8))
    assert str(e.value).startswith(words)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({}, "at least one field"),
        ({"img": Raw((0,))}, "field 'img': shape must be positive integers"),
        ({"img": Raw((2,), "nope")}, "field 'img': unknown dtype 'nope'"),
        ({"img": "uint8"}, "field 'img': expected Raw(shape, dtype) or Label()"),
    ],
)
def test_spec_is_validated(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TensorSpec(fields)


def _worker(pool: SlotPool, q: Any, batches: int, tag: int) -> None:
    for b in range(batches):
        n = 5
        slot = pool.acquire(tag, SPEC.batch_bytes(n))
        if slot < 0:
            buf = np.empty(SPEC.batch_bytes(n), dtype=np.uint8)
            packed = fill_batch(SPEC, _samples(n, b * n), ["s"] * n, buf)
            q.put(PackedBatch(packed.fields, packed.nbytes, packed.keys, -1, buf))
        else:
            packed = fill_batch(SPEC, _samples(n, b * n), ["s"] * n, pool.buffer(slot, SPEC.batch_bytes(n)))
            q.put(PackedBatch(packed.fields, packed.nbytes, packed.keys, slot))
    q.put(None)


def test_batches_cross_a_fork_through_slots_and_slots_come_back() -> None:
    ctx = multiprocessing.get_context("fork")
    pool = SlotPool(slots=3, slot_bytes=SPEC.batch_bytes(5))
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(pool, q, 8, 1))
    p.start()
    held, got = [], 0
    via_slot = via_pickle = 0
    while (item := q.get(timeout=30)) is not None:
        if item.slot >= 0:
            base = pool.open(item.slot, item.nbytes)
            via_slot += 1
        else:
            assert item.data is not None
            base = item.data
            via_pickle += 1
        batch = unpack(item, base)
        _check(batch, got * 5, 5)
        got += 1
        held.append(batch)  # the consumer keeps every batch: the pool runs dry, the rest is pickled
    p.join(30)
    assert p.exitcode == 0 and got == 8
    assert via_slot >= 3 and via_pickle >= 1 and pool.free_slots() == 0
    for i, batch in enumerate(held):  # slot contents were never overwritten while held
        _check(batch, i * 5, 5)
    held.clear()
    del batch, base
    gc.collect()
    assert pool.free_slots() == 3


def test_reclaim_frees_slots_of_ended_iterations_that_nobody_holds() -> None:
    pool = SlotPool(slots=4, slot_bytes=4096)
    assert [pool.acquire(t, 100) for t in (1, 1, 2, 3)] == [0, 1, 2, 3]
    kept = pool.open(1, 100)  # iteration 1's second batch is held by the consumer
    assert pool.acquire(1, 100) == -1  # none free
    assert pool.reclaim(live_tags=[3]) == 2  # slots 0 (iteration 1, never opened) and 2 (iteration 2)
    assert pool.free_slots() == 2 and pool.acquire(4, 5000) == -1  # a batch bigger than a slot is pickled
    del kept
    gc.collect()
    assert pool.free_slots() == 3


def test_a_pickled_pool_is_not_usable_and_batches_go_pickled() -> None:
    import pickle

    pool = pickle.loads(pickle.dumps(SlotPool(slots=2, slot_bytes=4096)))  # noqa: S301 - our own bytes, just pickled
    assert not pool.usable and pool.acquire(1, 10) == -1


# -- through make_loader, over a real split ---------------------------------------------------------
EU = "eu-west-1"
SAMPLE = 300  # the synthetic img field's size


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import subprocess
    import sys
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("tensors")
    geoshard = str(Path(sys.executable).with_name("geoshard"))
    argv = [geoshard, "synth", str(tmp / "c"), "--samples", "1500", "--sample-bytes", str(SAMPLE), "--shard-samples", "200"]
    subprocess.run(argv, check=True, capture_output=True, timeout=120)
    (tmp / "plan.toml").write_text(f'[shards]\nbytes = "40KB"\n\n[regions.{EU}]\nweight = 1\nlocal = "{tmp / "split" / EU}"\n')
    argv = [geoshard, "split", str(tmp / "c"), "--plan", str(tmp / "plan.toml"), "--out", str(tmp / "split"), "--workers", "1"]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    return tmp / "plan.toml"


def _truth(plan: Any) -> dict[str, tuple[bytes, int]]:
    from geoshard.formats import wds
    from geoshard.manifest import read_region_manifest

    folder = plan.parent / "split" / EU
    out = {}
    for s in read_region_manifest(folder).shards:
        with open(folder / s.path, "rb") as f:
            for k, m in wds.iter_samples(f, s.path):
                fields = wds.sample_fields(m)
                out[k.decode()] = (fields["img"], int(fields["cls"]))
    return out


TENSORS = TensorSpec({"img": Raw((SAMPLE,)), "cls": Label()})


def _loader(plan: Any, **kw: Any) -> Any:
    from geoshard.loaders import make_loader

    kw = {"num_workers": 2, **kw}
    return make_loader(plan, region=EU, batch_size=16, seed=1, shuffle_buffer=50, decode=TENSORS, **kw)


def _keys_and_check(batches: list[dict[str, Any]], truth: dict[str, tuple[bytes, int]]) -> list[str]:
    keys = []
    for b in batches:
        assert b["img"].dtype == torch.uint8 and b["img"].shape == (len(b["__key__"]), SAMPLE)
        for j, k in enumerate(b["__key__"]):
            img, label = truth[k]
            assert b["img"][j].numpy().tobytes() == img and int(b["cls"][j]) == label
        keys += b["__key__"]
    return keys


def test_make_loader_tensor_batches_cross_through_slots_with_every_guarantee(plan: Any) -> None:
    truth = _truth(plan)
    loader = _loader(plan)
    loader.set_epoch(2)
    batches = list(loader)  # every batch held at once: more than the pool's slots, the rest comes pickled
    keys = _keys_and_check(batches, truth)
    assert sorted(keys) == sorted(truth) and len(batches) == len(loader)  # every sample exactly once
    pool = loader._slots
    assert pool is not None and pool.free_slots() < pool.slots  # slots were used, and are held by our batches
    del batches
    gc.collect()
    assert pool.free_slots() == pool.slots
    # The same epoch with bytes batches gives the same order: decoding changes nothing else.
    from geoshard.loaders import make_loader

    plain = make_loader(plan, region=EU, batch_size=16, num_workers=2, seed=1, shuffle_buffer=50)
    plain.set_epoch(2)
    assert [k for b in plain for k in b["__key__"]] == keys


def test_tensor_batches_resume_exactly_and_stream_epochs(plan: Any) -> None:
    truth = _truth(plan)
    full = _keys_and_check(list(_loader(plan)), truth)
    run = _loader(plan)
    it = iter(run)
    head = _keys_and_check([next(it) for _ in range(5)], truth)
    state = run.state_dict()
    del it
    resumed = _loader(plan)
    resumed.load_state_dict(state)
    assert head + _keys_and_check(list(resumed), truth) == full
    streamed = _loader(plan, lookahead=3)
    s = streamed.stream()
    three = [next(s) for _ in range(3 * len(streamed))]  # three epochs; tags and slots are reused
    got = _keys_and_check(three, truth)
    assert got[: len(full)] == full and sorted(got) == sorted(list(truth) * 3)


def test_tensor_batches_without_workers_and_in_a_plain_dataloader(plan: Any) -> None:
    from torch.utils.data import DataLoader

    from geoshard.loaders import RegionalDataset

    truth = _truth(plan)
    main = _loader(plan, num_workers=0)
    assert sorted(_keys_and_check(list(main), truth)) == sorted(truth)
    ds = RegionalDataset(plan, EU, batch_size=16, seed=1, shuffle_buffer=50, decode=TENSORS)
    plain = DataLoader(ds, batch_size=None, num_workers=2)  # workers forked by torch: tensors, no slots
    assert sorted(_keys_and_check(list(plain), truth)) == sorted(truth)


def test_tensor_spec_needs_batches_and_wds(plan: Any) -> None:
    from geoshard.loaders import RegionalDataset

    with pytest.raises(ConfigError, match=r"decode=TensorSpec\(\.\.\.\) makes batches: pass batch_size"):
        RegionalDataset(plan, EU, decode=TENSORS)
    from geoshard.loaders import make_loader

    it = iter(make_loader(plan, region=EU, batch_size=16, num_workers=2, decode=TensorSpec({"img": Raw((SAMPLE + 1,))})))
    with pytest.raises(DataError, match=rf"field 'img': {SAMPLE} bytes, the TensorSpec wants {SAMPLE + 1}"):
        next(it)
