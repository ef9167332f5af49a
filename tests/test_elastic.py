"""Issue 19, part 4: elastic resume. The re-striping arithmetic over many (old, new) rank counts,
worker counts and cut points (hypothesis is not installed: a seeded loop); and the loaders over a
real split resumed on fewer and more ranks, with every key of the epoch once across the segments.
The torchrun runs (3 -> 2 and 2 -> 4 ranks, a region added) are in test_elastic_train.py."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_loaders import EU, region_samples, split

from geoshard.errors import ConfigError
from geoshard.loaders import RegionalDataset, make_loader
from geoshard.loaders.balance import Remainder
from geoshard.loaders.elastic import Segment, epoch_plan, region_states, rest_of_epoch
from geoshard.loaders.epoch import Layout, epoch_sequence, worker_order

CASES = 300


def _read(counts: list[int], epoch: int, layout: Layout, segments: tuple[Segment, ...], cuts: list[list[int]]) -> tuple[Segment, list[int]]:
    """Every rank of ``layout``'s world after ``segments``: the samples (manifest positions) its
    workers consume, each worker the first ``cuts[rank][worker]`` of its stream (capped), as the
    segment that records it."""
    read: list[int] = []
    rows = []
    for rank in range(layout.world_size):
        lay = dataclasses.replace(layout, rank=rank)
        plan = epoch_plan(counts, epoch, lay, segments)
        row = []
        for worker in range(lay.num_workers):
            order = worker_order(len(plan), worker, lay, epoch)
            take = min(cuts[rank][worker], len(order))
            starts = np.cumsum(counts) - np.asarray(counts)
            read += (starts[plan.shard[order[:take]]] + plan.index[order[:take]]).tolist()
            row.append(take)
        rows.append(tuple(row))
        per = len(plan)
    return Segment(layout.world_size, layout.num_workers, per, tuple(rows)), read


def _world(rng: random.Random, base: dict[str, Any]) -> Layout:
    return Layout(rank=0, world_size=rng.randint(1, 6), num_workers=rng.randint(1, 3), **base)


def test_restriping_reads_every_sample_of_the_epoch_once_over_many_worlds_and_cuts() -> None:
    """Three segments per case (two resumes on other worlds); the epoch's samples, read across all
    of them, are each read once, less a remainder under the last world's rank count (drop), or
    with at most that many read twice (pad); nothing outside the epoch is read."""
    rng = random.Random(19)
    for _ in range(CASES):
        counts = [rng.randint(0, 40) for _ in range(rng.randint(1, 7))]
        remainder: Remainder = rng.choice(["drop", "pad"])
        base = dict(batch_size=rng.randint(1, 8), seed=rng.randint(0, 99), shuffle=rng.random() < 0.8, remainder=remainder)
        base["shuffle_buffer"] = rng.choice([1, 4, 1000])
        epoch = rng.randint(0, 3)
        worlds = [_world(rng, base) for _ in range(3)]
        whole = epoch_sequence(counts, epoch, worlds[0])  # what the first world's epoch reads
        segments: tuple[Segment, ...] = ()
        seen: Counter[int] = Counter()
        for i, world in enumerate(worlds):
            last = i == len(worlds) - 1
            big = 10**9 if last else max(counts) + 1
            cuts = [[rng.randint(0, big) for _ in range(world.num_workers)] for _ in range(world.world_size)]
            seg, read = _read(counts, epoch, world, segments, cuts)
            seen.update(read)
            if not last:
                segments = (*segments, seg)
        epoch_ids = Counter(whole.ids.tolist())
        if remainder == "drop":
            assert max(seen.values(), default=1) == 1, "a sample read twice"
            assert not seen - epoch_ids, "a sample outside the epoch"
            assert 0 <= epoch_ids.total() - seen.total() < worlds[-1].world_size, (epoch_ids.total(), seen.total())
        else:  # each re-striping may wrap round: fewer repeats than its rank count
            assert not epoch_ids - seen, "a sample of the epoch left out"
            assert 0 <= seen.total() - epoch_ids.total() <= sum(w.world_size - 1 for w in worlds[1:])
            assert set(seen) <= set(epoch_ids)


def test_the_rest_of_an_epoch_is_a_few_hundred_bytes_per_region_in_lockstep() -> None:
    counts = [1000] * 200
    layout = Layout(world_size=64, num_workers=8, batch_size=32)
    seg = Segment(64, 8, 3125, ((96,) * 8,))  # every rank consumed alike: one row
    state = json.dumps(seg.to_json())
    assert len(state) < 200 and Segment.from_json(json.loads(state)) == seg
    rest = rest_of_epoch(counts, 0, layout, (seg,))
    assert len(rest.ids) == 200_000 - 64 * 8 * 96


def test_a_segment_that_says_more_than_a_stream_holds_is_refused() -> None:
    with pytest.raises(ConfigError, match="consumed 99 of its"):
        rest_of_epoch([10, 10], 0, Layout(world_size=2), (Segment(2, 1, 10, ((99,),)),))
    with pytest.raises(ConfigError, match="malformed segment"):
        Segment.from_json({"ranks": 2, "workers": 1, "per": 5, "consumed": [[1], [2], [3]]})


# -- the loaders over a real split ---------------------------------------------------------------


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split(tmp_path_factory.mktemp("elastic"), samples=1500)


ORDER: dict[str, Any] = {"region": EU, "batch_size": 8, "seed": 3, "shuffle_buffer": 40}  # the same in every segment


def _loader(plan: Path, rank: int, size: int, workers: int, per: int | None = None) -> Any:
    return make_loader(plan, region_rank=rank, region_size=size, samples_per_rank=per, num_workers=workers, **ORDER)


def _segment(
    plan: Path, size: int, workers: int, steps: int, states: list[dict[str, Any]] | None, per: int | None = None
) -> tuple[Counter[str], list[dict[str, Any]]]:
    """``size`` ranks each take ``steps`` batches (after resuming from ``states``, if any); their keys and states."""
    keys: Counter[str] = Counter()
    out = []
    for rank in range(size):
        loader = _loader(plan, rank, size, workers, per)
        if states is not None:
            loader.load_state_dict(region_states(json.loads(json.dumps(states)), EU))
        it = iter(loader)
        for _, batch in zip(range(steps), it, strict=False):
            keys.update(batch["__key__"])
        out.append(loader.state_dict())
        del it
    return keys, out


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 4), (1, 3)])
def test_loaders_resumed_on_another_rank_count_read_the_rest_of_the_epoch_once(plan: Path, old: int, new: int) -> None:
    region = Counter(s["__key__"] for s in region_samples(plan.parent / "split" / EU, "wds"))
    first, states = _segment(plan, old, 2, 7, None)
    assert states[0]["segments"] == [] and len(json.dumps(states[0])) < 400
    rest, after = _segment(plan, new, 1, 10**6, states)
    both = first + rest
    read_old = len(region) - len(region) % old  # the first world's epoch (drop: under `old` left out)
    assert max(both.values()) == 1 and set(both) <= set(region)
    assert 0 <= read_old - both.total() < new, (read_old, both.total())
    assert len({json.dumps(s["segments"]) for s in after}) == 1 and len(after[0]["segments"]) == 1
    # The next epoch is the new world's own: the whole region less its balance remainder, once.
    nxt: Counter[str] = Counter()
    for rank in range(new):
        loader = _loader(plan, rank, new, 1)
        loader.set_epoch(1)
        for batch in loader:
            nxt.update(batch["__key__"])
    assert max(nxt.values()) == 1 and nxt.total() == len(region) - len(region) % new


def test_a_region_removed_changes_the_samples_per_rank_and_the_rest_is_read_once(plan: Path) -> None:
    """The same two ranks, but the job's figure was another region's (100 per rank) and now is the
    region's own: the rest of the interrupted epoch is re-striped, not resumed as saved."""
    region = {s["__key__"] for s in region_samples(plan.parent / "split" / EU, "wds")}
    first, states = _segment(plan, 2, 2, 3, None, per=100)
    rest, _ = _segment(plan, 2, 2, 10**6, states)
    both = first + rest
    assert max(both.values()) == 1 and set(both) <= region and both.total() == 200


def test_same_world_resume_keeps_the_saved_position_and_a_partial_region_is_refused(plan: Path) -> None:
    _, states = _segment(plan, 3, 2, 4, None)
    own = _loader(plan, 1, 3, 2)
    own.load_state_dict(states[1])  # its own state alone, as before elastic resume
    assert own.dataset.consumption.consumed == states[1]["consumed"] and own.dataset.consumption.segments == ()
    with pytest.raises(ConfigError, match=r"pass the states of all the region's saved ranks \(region_states\); rank\(s\) \[0, 2\]"):
        _loader(plan, 0, 2, 2).load_state_dict(states[1])
    with pytest.raises(ConfigError, match="batch_size is 8 there, 16 here"):
        make_loader(plan, region=EU, region_rank=0, region_size=2, batch_size=16, seed=3, shuffle_buffer=40).load_state_dict(
            region_states(states, EU)
        )


def test_a_region_without_a_saved_position_begins_the_jobs_epoch(plan: Path) -> None:
    ds = RegionalDataset(plan, region=EU, region_rank=0, region_size=1)
    ds.load_state_dict(region_states([{"region": "us-east-1", "region_rank": 0, "epoch": 4}], EU))
    assert ds.epoch == 4 and ds.consumption.segments == ()
