"""Which samples a rank's DataLoader worker yields in an epoch, in which order: pure arithmetic on
the manifest's sample counts, so every rank of a region computes the same plan without talking to
the others, and a resumed run can skip exactly what was consumed without reading it again.

``rank`` and ``world_size`` here are the rank's place in its region and the region's rank count:
a region's samples are split among that region's ranks only. ``samples_per_rank`` is decided for
the whole job (``balance.py``) so that every rank of every region yields the same count.

1. The region's shards, in manifest order, are permuted with ``(seed, epoch)``: the same on every
   rank of the region.
2. An epoch reads ``samples_per_rank * world_size`` samples. When that is fewer than the region
   has, the samples left out are a block of the region's samples (by manifest position) that moves
   on by its own length every epoch: after E epochs every sample was read E or E-1 times (when
   E blocks fit in the region), none is lost for good. When it is more (``remainder="pad"``),
   a block of samples is repeated, moving on the same way.
3. What is read, in the permuted shard order (the epoch's canonical sequence, ``EpochSequence``:
   it depends on the rank count only through how much is left out), is cut into ``world_size``
   equal contiguous ranges; a rank reads only the shards of its range (a shard on a boundary is
   read by both neighbours). ``elastic.py`` continues an interrupted epoch from that sequence on
   another world.
4. The rank's stream is cut into batches and the batches into ``num_workers`` contiguous runs, so
   each worker reads its own shards and every rank yields the same number of batches.
5. Within a worker's run, samples are shuffled inside consecutive windows (seeded by seed, epoch,
   rank and worker): a block shuffle, whose memory is bounded by the shards a window spans. The
   first window is one batch, each next one a quarter longer than the last, up to
   ``shuffle_buffer`` samples: a worker's first batch needs only its own samples (a chunk or two
   of a shard, not the whole first ``shuffle_buffer``), so it can come as soon as they have
   crossed the link. All of a window is needed at its start, so while windows grow a reader must
   fetch ahead faster than it consumes, by about the growth factor: a quarter keeps that under
   what the benchmarked links carry, where doubling would not (measured in docs/benchmarks.md,
   loaders section).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from geoshard.errors import ConfigError
from geoshard.loaders.balance import Remainder, check_remainder, even_share


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
    samples_per_rank: int | None = None  # job-wide; None: this region's samples / world_size

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.samples_per_rank is not None and self.samples_per_rank < 0:
            raise ConfigError(f"samples_per_rank must be 0 or more, got {self.samples_per_rank}")
        if self.num_workers < 1 or self.batch_size < 1 or self.shuffle_buffer < 1:
            raise ConfigError("num_workers, batch_size and shuffle_buffer must be at least 1")
        check_remainder(self.remainder)


@dataclass(frozen=True)
class RankPlan:
    shard: np.ndarray  # per position of the rank's stream: index into the manifest's shards
    index: np.ndarray  # ... and the sample's position inside that shard
    dropped: int  # samples of the region no rank yields this epoch
    padded: int  # samples yielded twice in the epoch across the region's ranks

    def __len__(self) -> int:
        return len(self.shard)

    def batches(self, batch_size: int) -> int:
        return -(-len(self.shard) // batch_size)

    def worker_range(self, worker: int, layout: Layout) -> tuple[int, int]:
        """Positions ``[start, stop)`` of the rank's stream that logical worker ``worker`` yields."""
        return worker_range(len(self), worker, layout)

    def worker_stream(self, worker: int, layout: Layout, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard, index) per sample that logical ``worker`` yields, in order."""
        pos = worker_order(len(self), worker, layout, epoch)
        return self.shard[pos], self.index[pos]


def worker_range(n: int, worker: int, layout: Layout) -> tuple[int, int]:
    """Positions ``[start, stop)`` of a rank's stream of ``n`` samples that logical ``worker`` yields."""
    nb = -(-n // layout.batch_size)
    b0 = worker * nb // layout.num_workers
    b1 = (worker + 1) * nb // layout.num_workers
    return min(b0 * layout.batch_size, n), min(b1 * layout.batch_size, n)


def worker_order(n: int, worker: int, layout: Layout, epoch: int) -> np.ndarray:
    """The positions of a rank's stream of ``n`` samples that logical ``worker`` yields, in the order it yields them."""
    start, stop = worker_range(n, worker, layout)
    m = stop - start
    perm = np.arange(m)
    if layout.shuffle and layout.shuffle_buffer > 1 and m > 1:
        # Shuffled inside the worker's own range, so workers never read each other's shards.
        rng = _rng(layout.seed, epoch, layout.rank, worker, 1)
        for s, e in itertools.pairwise(windows(m, layout)):
            perm[s:e] = s + rng.permutation(e - s)
    return start + perm


def windows(n: int, layout: Layout) -> list[int]:
    """Where the shuffle windows of a worker's ``n`` samples begin, and ``n``: one batch first,
    then each a quarter longer than the last, up to ``shuffle_buffer``."""
    out, pos, w = [0], 0, min(layout.batch_size, layout.shuffle_buffer)
    while pos < n:
        pos = min(n, pos + w)
        out.append(pos)
        w = min(w + max(1, w // 4), layout.shuffle_buffer)
    return out


def need_positions(n: int, layout: Layout) -> np.ndarray:
    """For each of a worker's ``n`` samples, the position from which it may be yielded: the start
    of its shuffle window (any sample of a window may come first), or its own without shuffling."""
    pos = np.arange(n, dtype=np.int64)
    if not (layout.shuffle and layout.shuffle_buffer > 1):
        return pos
    bounds = np.asarray(windows(n, layout), dtype=np.int64)
    return bounds[np.searchsorted(bounds, pos, side="right") - 1]


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


def per_rank(total: int, layout: Layout) -> int:
    """Samples each rank yields per epoch: the job's figure, else this region's alone."""
    if layout.samples_per_rank is not None:
        return layout.samples_per_rank
    return even_share(total, layout.world_size, layout.remainder)


@dataclass(frozen=True)
class EpochSequence:
    """What a region's ranks read in (the rest of) an epoch, in order, before it is cut among them."""

    ids: np.ndarray  # manifest positions of the samples
    starts: np.ndarray  # manifest position of each shard's first sample
    dropped: int  # samples of the region the sequence leaves out
    padded: int  # samples it holds twice

    def positions(self, rank: int, per: int) -> np.ndarray:
        """Where rank ``rank``'s ``per`` samples sit in the sequence: the rank's contiguous range,
        wrapping round when the ranks read more than it holds (``pad`` after a re-striping)."""
        if per == 0 or len(self.ids) == 0:
            return np.zeros(0, dtype=np.int64)
        return (rank * per + np.arange(per, dtype=np.int64)) % len(self.ids)

    def rank_plan(self, rank: int, per: int) -> RankPlan:
        mine = self.ids[self.positions(rank, per)]
        shard = np.searchsorted(self.starts, mine, side="right") - 1
        return RankPlan(shard=shard, index=mine - self.starts[shard], dropped=self.dropped, padded=self.padded)


def epoch_sequence(counts: Sequence[int], epoch: int, layout: Layout) -> EpochSequence:
    """The epoch's samples for ``layout.world_size`` ranks of ``per_rank`` samples each, in the
    region's canonical order: its shards permuted with ``(seed, epoch)``, independent of the rank count."""
    c_all = np.asarray(counts, dtype=np.int64)
    total = int(c_all.sum())
    read = per_rank(total, layout) * layout.world_size  # samples the region's ranks read this epoch
    starts = np.cumsum(c_all) - c_all  # manifest position of each shard's first sample
    if total == 0 or read == 0:
        return EpochSequence(np.zeros(0, dtype=np.int64), starts, total, 0)
    order = _rng(layout.seed, epoch).permutation(len(c_all)) if layout.shuffle else np.arange(len(c_all))
    c = c_all[order]
    # Manifest positions of the region's samples in the permuted shard order.
    ids = np.repeat(starts[order] - (np.cumsum(c) - c), c) + np.arange(total, dtype=np.int64)
    if read <= total:
        out = total - read  # the block left out this epoch starts where last epoch's ended
        lo = (epoch * out) % total
        ids = ids[(ids - lo) % total >= out] if out else ids
        return EpochSequence(ids, starts, out, 0)
    extra = read - total  # repeated: a moving block too, appended after the whole region
    ids = np.concatenate([ids, (epoch * extra + np.arange(extra, dtype=np.int64)) % total])
    return EpochSequence(ids, starts, 0, extra)


def rank_plan(counts: Sequence[int], epoch: int, layout: Layout) -> RankPlan:
    seq = epoch_sequence(counts, epoch, layout)
    return seq.rank_plan(layout.rank, per_rank(int(np.sum(counts)), layout))
