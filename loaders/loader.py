"""``make_loader``: a torch ``DataLoader`` over a ``RegionalDataset`` that batches inside its
workers, tracks what the training loop consumed (for exact resume) and gathers the workers' tier
counters; and ``timed``, which measures how long the consumer waits for each batch.

Batches are collated in the workers so each crosses the process boundary as one pickled object.
The workers of an iteration share one fetch order (``fetchqueue.py``), made here before they fork.
Tiers a worker found failing stay cooled down for the workers of the next epoch, which fork from
the training process. DataLoader hands out worker results round-robin, skipping exhausted
workers; a resumed epoch rotates which logical worker each process plays so that the rest of the
stream comes out in the original order. The loader state carries the rank's egress count
(``egress.py``), so its budget holds across workers, epochs and resumes.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from geoshard.errors import ConfigError, DataError
from geoshard.loaders.chain import ChainSettings
from geoshard.loaders.dataset import RegionalDataset
from geoshard.loaders.decode import PackedBatch, unpack
from geoshard.loaders.egress import check_count
from geoshard.loaders.elastic import own_state
from geoshard.loaders.handoff import EpochStart, WorkerFailure
from geoshard.loaders.slots import SlotPool
from geoshard.loaders.stats import StatsSnapshot, merge
from geoshard.plan import Plan

EGRESS_KEY = "egress_bytes"  # in the loader state: the rank's cross-region bytes so far


def _as_is(item: Any) -> Any:
    return item


class RegionalLoader(DataLoader[Any]):
    dataset: RegionalDataset

    def __init__(self, dataset: RegionalDataset, num_workers: int = 2, lookahead: int = 16, **kwargs: Any) -> None:
        if kwargs.get("persistent_workers"):
            # Workers started once would keep the first epoch's start (epoch, skips, rotation).
            raise ConfigError("persistent_workers is not supported: each epoch's workers start where that epoch starts")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be 0 or more, got {num_workers}")
        if not num_workers:  # no workers to wait for: the rank's own reads are bounded by its tiers' timeouts
            kwargs["timeout"] = 0  # (DataLoader refuses one at the first batch)
        # collate_fn: items pass as the workers made them (DataLoader would turn numpy arrays into
        # tensors, which cross processes through a shared-memory segment each: slow for small ones).
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=_as_is, **kwargs)
        if kwargs.get("multiprocessing_context") is not None:  # the workers' own kind of shared memory
            dataset.egress = dataset.egress.moved_to(self.multiprocessing_context)
        self.lookahead = lookahead  # batches before an epoch's end at which stream() starts the next one
        self._snapshots: dict[tuple[int, int], StatsSnapshot] = {}  # (iteration, worker) -> its latest counters
        self._iterations = 0
        # TensorSpec batches from forked workers: shared slots (slots.py), made at the first fork.
        self._slots: SlotPool | None = None
        self._slot_tags: dict[int, weakref.ref[Any]] = {}  # tag -> the iteration (DataLoader iterator) using it

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """One epoch: the dataset's current one (or the rest of it, after ``load_state_dict``)."""
        start = self.dataset.begin(max(self.num_workers, 1), tagged=True)
        return self._unwrap(self._spawn(start))

    def stream(self) -> Iterator[Any]:
        """Batches epoch after epoch, without end (``set_epoch`` is done here).

        ``lookahead`` batches before an epoch ends, the next epoch's workers start, so its first
        shards are fetched while this epoch drains instead of after it: no stall at the boundary.
        With ``follow_refresh`` the next epoch's generation is agreed there too, so an epoch that
        moves to a new generation starts its workers as early as any other.
        """
        it = iter(self)
        while True:
            ds = self.dataset
            left = ds.items_left()
            nxt: Iterator[Any] | None = None
            for item in it:
                yield item
                left -= 1
                if nxt is None and self.num_workers and left <= self.lookahead:
                    # (Forking in a helper thread would hide its cost, but workers forked off a
                    # non-main thread die at start-up here; DataLoader expects the main thread.)
                    ds.follow(ds.epoch + 1)  # every rank is at this batch now: the generation is agreed here
                    nxt = self._spawn(EpochStart.fresh(ds.epoch + 1, self.num_workers, tagged=True))
            if nxt is None:
                ds.follow(ds.epoch + 1)
            ds.set_epoch(ds.epoch + 1)
            started = ds.begin(max(self.num_workers, 1), tagged=True)  # the consumer's position: the new epoch's start
            it = self._unwrap(nxt) if nxt is not None else self._unwrap(self._spawn(started))

    def _spawn(self, start: EpochStart) -> Iterator[Any]:
        tag = self._slot_tag() if self.dataset.tensors is not None and self.num_workers else 0
        if tag:
            start = dataclasses.replace(start, slots=self._slots, slot_tag=tag)
        if self.num_workers:  # the rank's fetch order, inherited by the workers forked below (fetchqueue.py)
            start = dataclasses.replace(start, fetch_queue=self.dataset.fetch_queue(start))
        with self.dataset.handing_over(start):
            # Forks the workers, which take the start with them; without workers the generator is
            # made here, in this process, with the start bound to it.
            it = super().__iter__()
        if tag:
            self._slot_tags[tag] = weakref.ref(it)
        return it

    def _slot_tag(self) -> int:
        """A tag for the next iteration's slots; slots of ended iterations nobody holds are freed."""
        ds = self.dataset
        assert ds.tensors is not None
        if self._slots is None:
            # Per worker: the batches DataLoader lets it queue, one being filled, two the consumer
            # holds; twice, for stream()'s overlap of two epochs.
            per_worker = (self.prefetch_factor or 2) + 3
            self._slots = SlotPool(2 * self.num_workers * per_worker, ds.tensors.batch_bytes(ds.layout.batch_size))
        self._slot_tags = {t: ref for t, ref in self._slot_tags.items() if ref() is not None}
        live = set(self._slot_tags)
        self._slots.reclaim(live)
        tag = next(t for t in range(1, 256) if t not in live)  # at most a few iterations are alive
        return tag

    def _unwrap(self, it: Iterator[Any]) -> Iterator[Any]:
        ds = self.dataset
        self._iterations += 1
        iteration = self._iterations
        counting = self.num_workers > 0  # in the main process the dataset counts for itself
        for worker, n, stats, item in self._bounded(it):
            if isinstance(item, WorkerFailure):
                raise item.error
            if counting:
                ds.record(worker, n)
            if stats is not None and counting:  # without workers, stats() reads this process's chain directly
                # The next epoch's workers fork from this process: they inherit what failed.
                snapshot, cooldowns, warnings = stats
                ds.chain().warn_once(warnings)  # before the cooldowns, which mark their tiers as logged
                ds.chain().note_cooldowns(cooldowns)
                self._snapshots[(iteration, worker)] = snapshot
            if isinstance(item, PackedBatch):  # TensorSpec: views of its shared slot (or of its own array)
                item = unpack(item, self._slots.open(item.slot, item.nbytes) if self._slots and item.slot >= 0 else item.data)
            yield item

    def _bounded(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it``, where DataLoader's ``timeout`` (no batch from the workers in that long) is a
        one-line DataError instead of its RuntimeError."""
        while True:
            try:
                got = next(it)
            except StopIteration:
                return
            except RuntimeError as e:
                if not (self.timeout and str(e).startswith("DataLoader timed out")):
                    raise
                ds = self.dataset
                raise DataError(
                    f"region {ds.region} rank {ds.rank}: no batch from the loader's workers in {self.timeout:g} s (the loader's "
                    "timeout); a worker is stuck: SIGUSR1 to it prints where, under geoshard train (docs/cli.md)"
                ) from None
            yield got

    def __len__(self) -> int:
        # DataLoader's own would also warn when an epoch yields more items than this, as one
        # resumed on fewer ranks may (elastic.py).
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """With ``follow_refresh``, collective: every rank sets the same epoch (its generation is agreed)."""
        self.dataset.follow(epoch)
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position, and the bytes this rank read from other regions' buckets: a
        resume continues the count, so the egress budget holds across it."""
        return {**self.dataset.state_dict(), EGRESS_KEY: self.dataset.egress.used}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A state saved before the count was kept has none: it continues from 0, as it did then.
        # From region_states (a resume on any ranks), this rank's saved count (elastic.own_state).
        own = own_state(state, self.dataset.rank) if "ranks" in state else state
        used = check_count((own or {}).get(EGRESS_KEY, 0), f"the loader state's {EGRESS_KEY} (a checkpoint's)")
        self.dataset.load_state_dict(state)
        self.dataset.egress.restore(used)

    def stats(self) -> dict[str, Any]:
        """Tier counters of every worker so far, plus the epoch's remainder."""
        # This process's own chain read the manifest (and, without workers, everything).
        snaps = [*self._snapshots.values(), self.dataset.chain().stats.snapshot()]
        out = merge(snaps).to_dict()
        out.update(self.dataset.remainder())
        out["epoch"] = self.dataset.epoch
        return out


def make_loader(
    plan: Plan | str | os.PathLike[str],
    region: str | None = None,
    *,
    batch_size: int = 32,
    num_workers: int = 2,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
    timeout: float = 0,
    lookahead: int = 16,
    **dataset_kwargs: Any,
) -> RegionalLoader:
    """A DataLoader of batches of this rank's share of ``region``; see ``RegionalDataset`` for the rest."""
    settings = dataset_kwargs.pop("settings", None) or ChainSettings()
    ds = RegionalDataset(plan, region, batch_size=batch_size, collate_fn=collate_fn, settings=settings, **dataset_kwargs)
    return RegionalLoader(ds, num_workers=num_workers, lookahead=lookahead, pin_memory=pin_memory, timeout=timeout)


class Timed:
    """Iterate ``loader`` while recording how long each ``next()`` blocked: the data wait."""

    def __init__(self, loader: Iterable[Any], clock: Callable[[], float] = time.perf_counter) -> None:
        self.loader = loader
        self.clock = clock
        self.waits: list[float] = []
        self.first_batch_s: float | None = None

    def __iter__(self) -> Iterator[Any]:
        clock = self.clock
        t_start = clock()
        it = iter(self.loader)
        while True:
            t0 = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            t1 = clock()
            self.waits.append(t1 - t0)
            if self.first_batch_s is None:
                self.first_batch_s = t1 - t_start
            yield item

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batches": len(self.waits),
            "wait_s": sum(self.waits),
            "wait_max_s": max(self.waits, default=0.0),
            "wait_after_first_s": sum(self.waits[1:]),
            "time_to_first_batch_s": self.first_batch_s,
        }
        inner = getattr(self.loader, "stats", None)
        if callable(inner):
            out["loader"] = inner()
        return out


def timed(loader: Iterable[Any]) -> Timed:
    return Timed(loader)
