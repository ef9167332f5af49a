"""What a worker yields from its samples: each alone, or batches (``collate_fn``, or packed into
tensors by a ``TensorSpec``); and, for ``RegionalLoader``, its tier counters now and then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from geoshard.loaders.chain import TierChain
from geoshard.loaders.decode import TensorSpec, pack
from geoshard.loaders.handoff import EpochStart
from geoshard.loaders.stats import StatsSnapshot

STATS_EVERY_S = 0.25  # how often a DataLoader worker ships its counters with a batch


def item_count(samples: int, batch_size: int) -> int:
    """Items made of ``samples`` samples (``batch_size`` 0: unbatched)."""
    return -(-samples // batch_size) if batch_size else samples


def make_items(
    samples: Iterable[tuple[Any, str]],
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any],
    tensors: TensorSpec | None,
    start: EpochStart,
) -> Iterator[tuple[int, Any]]:
    """(samples in it, item) from (sample, its shard's path): each sample alone with ``batch_size``
    0, else batches of ``batch_size`` (the last may be short)."""
    if not batch_size:
        for sample, _ in samples:
            yield 1, sample
        return
    batch: list[Any] = []
    paths: list[str] = []  # each sample's shard, for a TensorSpec's errors

    def made() -> Any:
        if tensors is not None:
            return pack(tensors, batch, paths, start.slots, start.slot_tag, start.tagged)
        return collate_fn(batch)

    for sample, path in samples:
        batch.append(sample)
        paths.append(path)
        if len(batch) == batch_size:
            yield len(batch), made()
            batch, paths = [], []
    if batch:
        yield len(batch), made()


# What a worker ships with an item now and then: counters, tier cooldowns, failures to log once.
Shipped = tuple[StatsSnapshot, dict[str, float], dict[str, str]]


class StatsShipper:
    """The worker's counters to send with item ``i`` of ``items``: now and then (every
    ``STATS_EVERY_S``) and with the last, else None."""

    def __init__(self, chain: TierChain, items: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.chain, self.last, self.clock = chain, items - 1, clock
        self.shipped = clock()

    def take(self, i: int) -> Shipped | None:
        """(counters, tier cooldowns, failures to log once) or None."""
        warnings = self.chain.take_warnings()
        if not warnings and i != self.last and self.clock() - self.shipped < STATS_EVERY_S:
            return None
        self.shipped = self.clock()
        return self.chain.stats.snapshot(), self.chain.cooldowns(), warnings
