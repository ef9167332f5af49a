"""``make_loader``: a torch ``DataLoader`` over a ``RegionalDataset`` that batches inside its
workers, tracks what the training loop consumed (for exact resume) and gathers the workers' tier
counters; and ``timed``, which measures how long the consumer waits for each batch.

Batches are collated in the workers so each crosses the process boundary as one pickled object.
Tiers a worker found failing stay cooled down for the workers of the next epoch, which fork
from the training process. DataLoader hands out worker results round-robin, skipping exhausted workers; a resumed epoch
rotates which logical worker each process plays so that the rest of the stream comes out in the
original order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from geoshard.loaders.dataset import RegionalDataset, WorkerFailure
from geoshard.loaders.stats import merge_snapshots
from torch.utils.data import DataLoader

from geoshard.plan import Plan


class RegionalLoader(DataLoader[Any]):
    dataset: RegionalDataset

    def __init__(self, dataset: RegionalDataset, num_workers: int = 2, **kwargs: Any) -> None:
        dataset._tagged = True
        super().__init__(dataset, batch_size=None, num_workers=num_workers, **kwargs)
        self._finished: list[dict[str, Any]] = []  # counters of workers of earlier iterations
        self._current: dict[int, dict[str, Any]] = {}

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self.dataset
        if self.num_workers == 0:
            it = super().__iter__()
        else:
            ds._worker_start = ds._start(self.num_workers)
            it = super().__iter__()  # forks the workers, which take _worker_start with them
            ds._worker_start = None
        self._finished.extend(self._current.values())
        self._current = {}
        return self._unwrap(it)

    def _unwrap(self, it: Iterator[Any]) -> Iterator[Any]:
        ds = self.dataset
        counting = self.num_workers > 0  # in the main process the dataset counts for itself
        for worker, n, stats, item in it:
            if isinstance(item, WorkerFailure):
                raise item.error
            if counting:
                ds.record(worker, n)
            if stats is not None:
                # The next epoch's workers fork from this process: they inherit what failed.
                ds.chain().note_cooldowns(stats.pop("cooldowns", {}))
                self._current[worker] = stats
            yield item

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        """Tier counters of every worker so far, plus the epoch's remainder."""
        # This process's own chain read the manifest (and, without workers, everything).
        snaps = [*self._finished, *self._current.values(), self.dataset.chain().stats.snapshot()]
        out = merge_snapshots(snaps)
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
    **dataset_kwargs: Any,
) -> RegionalLoader:
    """A DataLoader of batches of this rank's share of ``region``; see ``RegionalDataset`` for the rest."""
    ds = RegionalDataset(plan, region, batch_size=batch_size, collate_fn=collate_fn, **dataset_kwargs)
    return RegionalLoader(ds, num_workers=num_workers, pin_memory=pin_memory, timeout=timeout)


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
