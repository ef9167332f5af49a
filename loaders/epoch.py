"""Which samples a rank's DataLoader worker yields in an epoch, in which order: pure arithmetic on
the manifest's sample counts, so every rank computes the same plan without talking to the others,
and a resumed run can skip exactly what was consumed without reading it again.

1. The region's shards, in manifest order, are permuted with ``(seed, epoch)``: the same on every rank.
2. Their samples, concatenated, are cut into ``world_size`` equal contiguous ranges: a rank reads
   only the shards of its range (a shard on a boundary is read by both neighbours). The remainder
   (fewer than ``world_size`` samples) is dropped, or with ``remainder="pad"`` the last ranks wrap
   around to the start, so every rank yields the same count and DDP collectives never hang.
3. The rank's stream is cut into batches and the batches into ``num_workers`` contiguous runs, so
   each worker reads its own shards and every rank yields the same number of batches.
4. Within a worker's run, samples are shuffled inside consecutive windows of ``shuffle_buffer``
   samples (seeded by seed, epoch, rank and worker): a block shuffle, whose memory is bounded by
   the shards a window spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from geoshard.errors import ConfigError

Remainder = Literal["drop", "pad"]


@dataclass(frozen=True)
class Layout:
    rank: int = 0
    world_size: int = 1
    num_workers: int = 1  # logical workers: DataLoader workers, or 1 in the main process
    batch_size: int = 1  # samples per yielded item when batching in the dataset
    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 1000
    remainder: Remainder = "drop"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.num_workers < 1 or self.batch_size < 1 or self.shuffle_buffer < 1:
            raise ConfigError("num_workers, batch_size and shuffle_buffer must be at least 1")
        if self.remainder not in ("drop", "pad"):
            raise ConfigError(f"remainder must be 'drop' or 'pad', got {self.remainder!r}")


@dataclass(frozen=True)
class RankPlan:
    shard: np.ndarray  # per position of the rank's stream: index into the manifest's shards
    index: np.ndarray  # ... and the sample's position inside that shard
    dropped: int  # samples of the region no rank yields this epoch (remainder "drop")
    padded: int  # samples yielded twice in the epoch across ranks (remainder "pad")

    def __len__(self) -> int:
        return len(self.shard)

    def batches(self, batch_size: int) -> int:
        return -(-len(self.shard) // batch_size)

    def worker_range(self, worker: int, layout: Layout) -> tuple[int, int]:
        """Positions ``[start, stop)`` of the rank's stream that logical worker ``worker`` yields."""
        nb = self.batches(layout.batch_size)
        b0 = worker * nb // layout.num_workers
        b1 = (worker + 1) * nb // layout.num_workers
        return min(b0 * layout.batch_size, len(self)), min(b1 * layout.batch_size, len(self))

    def worker_stream(self, worker: int, layout: Layout, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard, index) per sample that logical ``worker`` yields, in order."""
        start, stop = self.worker_range(worker, layout)
        shard, index = self.shard[start:stop], self.index[start:stop]
        n = stop - start
        if layout.shuffle and layout.shuffle_buffer > 1 and n > 1:
            # Shuffled inside the worker's own range, so workers never read each other's shards.
            rng = _rng(layout.seed, epoch, layout.rank, worker, 1)
            w = layout.shuffle_buffer
            perm = np.arange(n)
            for s in range(0, n, w):
                perm[s : s + w] = s + rng.permutation(min(w, n - s))
            shard, index = shard[perm], index[perm]
        return shard, index


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


def rank_plan(counts: Sequence[int], epoch: int, layout: Layout) -> RankPlan:
    n = len(counts)
    order = _rng(layout.seed, epoch).permutation(n) if layout.shuffle else np.arange(n)
    c = np.asarray(counts, dtype=np.int64)[order]
    total = int(c.sum())
    ends = np.cumsum(c)
    world = layout.world_size
    per = total // world if layout.remainder == "drop" else -(-total // world)
    dropped = total - per * world if layout.remainder == "drop" else 0
    padded = per * world - total if layout.remainder == "pad" else 0
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return RankPlan(empty, empty, 0, 0)
    # Global positions of this rank; "pad" wraps past the end to the start of the epoch.
    pos = (np.arange(layout.rank * per, (layout.rank + 1) * per, dtype=np.int64)) % total
    which = np.searchsorted(ends, pos, side="right")  # position in the permuted shard order
    index = pos - (ends[which] - c[which])
    return RankPlan(shard=order[which], index=index, dropped=dropped, padded=padded)
