"""What a worker fetches, and when: its stream of samples cut into pieces of shards.

A piece is a run of chunks of one shard (``ShardChunks`` in the manifest: runs of whole samples,
each with its own hash) that the worker's stream first needs at the same position, fetched with
one ranged request; a shard without chunk hashes (an older manifest), or one read whole (a local
replica to write back to, ``verify="sha256"``), is a single piece. Samples of a shuffle window may
come in any order, so a window's samples are all needed at its start (``epoch.need_positions``).
With the first window one batch long, a worker's first piece is the chunk or two its first batch
needs, not a whole shard.

Pure arithmetic on the manifest and the epoch plan, like ``epoch.py``: every worker of a rank, and
the training process that lays out the rank's fetch order (``fetchqueue.py``), compute the same
pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from geoshard.loaders.elastic import Segment, epoch_plan
from geoshard.loaders.epoch import Layout, need_positions
from geoshard.manifest import ShardEntry


@dataclass(frozen=True)
class Piece:
    shard: int  # index into the manifest's shards
    first: int  # first and last chunk (0, 0: the whole shard)
    last: int
    chunked: bool  # read by chunks (checked per chunk) or whole (checked whole)
    need: int  # position in the worker's (resumed) stream from which its samples are needed
    ordinal: int  # which of the worker's shards, by first use, it belongs to
    sample0: int  # the shard's index of its first sample
    length: int  # bytes


class ChunkMap:
    """Per shard: the sample and byte ends of its chunks (one chunk if it is read whole), worked
    out when first asked: a version 2 manifest's chunks come from each shard's chunk index
    (``resolve``: ``TierChain.with_chunks``), fetched only for the shards a rank reads."""

    def __init__(self, shards: Sequence[ShardEntry], chunked: bool, resolve: Callable[[ShardEntry], ShardEntry] | None = None) -> None:
        self._shards, self._chunked, self._resolve = shards, chunked, resolve
        self._ends: dict[int, tuple[bool, np.ndarray, np.ndarray]] = {}
        self.chunked = _Lazy(self, 0)
        self.sample_ends = _Lazy(self, 1)
        self.byte_ends = _Lazy(self, 2)

    def ends(self, i: int) -> tuple[bool, np.ndarray, np.ndarray]:
        got = self._ends.get(i)
        if got is None:
            s = self._shards[i]
            if self._chunked and self._resolve is not None:
                s = self._resolve(s)
            if self._chunked and s.chunks is not None and len(s.chunks.bytes) > 1:
                got = (True, np.cumsum(np.asarray(s.chunks.samples, dtype=np.int64)), np.cumsum(np.asarray(s.chunks.bytes, dtype=np.int64)))
            else:
                got = (False, np.asarray([s.samples], dtype=np.int64), np.asarray([s.bytes], dtype=np.int64))
            self._ends[i] = got
        return got


class _Lazy:
    """One of ``ChunkMap``'s per-shard lists, indexed as before."""

    def __init__(self, cmap: ChunkMap, field: int) -> None:
        self._cmap, self._field = cmap, field

    def __getitem__(self, i: int) -> Any:
        return self._cmap.ends(i)[self._field]


@dataclass(frozen=True)
class WorkerPieces:
    chunks: np.ndarray  # per sample of the stream: the chunk of its shard that holds it
    pieces: list[Piece]  # in the order the stream needs them
    last_use: dict[int, int]  # key(shard, chunk) -> the stream position that uses it last


def key(shard: int, chunk: int) -> int:
    return (shard << 32) | chunk


def worker_pieces(shards: np.ndarray, indices: np.ndarray, need: np.ndarray, cmap: ChunkMap) -> WorkerPieces:
    """The pieces of a worker's stream: ``shards``/``indices`` per sample, ``need`` the position
    from which each sample may be yielded (non-decreasing)."""
    n = len(shards)
    chunks = np.zeros(n, dtype=np.int64)
    if n == 0:
        return WorkerPieces(chunks, [], {})
    shards = shards.astype(np.int64)
    for s in np.unique(shards).tolist():
        if cmap.chunked[s]:
            m = shards == s
            chunks[m] = np.searchsorted(cmap.sample_ends[s], indices[m], side="right")
    keys = (shards << 32) | chunks
    uniq, first_pos = np.unique(keys, return_index=True)
    _, rev = np.unique(keys[::-1], return_index=True)
    last_pos = n - 1 - rev
    u_shard, u_chunk = uniq >> 32, uniq & 0xFFFFFFFF
    # The worker's shards numbered by first use: read-ahead is counted in shards, as before chunks.
    shard_ids, shard_first = np.unique(shards, return_index=True)
    ordinal_of = dict(zip(shard_ids[np.argsort(shard_first)].tolist(), range(len(shard_ids)), strict=True))
    u_need = need[first_pos]
    u_ord = np.asarray([ordinal_of[s] for s in u_shard.tolist()], dtype=np.int64)
    order = np.lexsort((u_chunk, u_ord, u_need))
    pieces: list[Piece] = []
    for i in order.tolist():
        s, c, nd, od = int(u_shard[i]), int(u_chunk[i]), int(u_need[i]), int(u_ord[i])
        p = pieces[-1] if pieces else None
        if p is not None and p.chunked and p.shard == s and p.need == nd and p.last + 1 == c:
            pieces[-1] = Piece(s, p.first, c, True, nd, od, p.sample0, p.length + _chunk_bytes(cmap, s, c))
            continue
        sample0 = int(cmap.sample_ends[s][c - 1]) if c else 0
        pieces.append(Piece(s, c, c, cmap.chunked[s], nd, od, sample0, _chunk_bytes(cmap, s, c)))
    last_use = dict(zip(uniq.tolist(), last_pos.tolist(), strict=True))
    return WorkerPieces(chunks, pieces, last_use)


def _chunk_bytes(cmap: ChunkMap, shard: int, chunk: int) -> int:
    ends = cmap.byte_ends[shard]
    return int(ends[chunk] - (ends[chunk - 1] if chunk else 0))


def rank_order(per_worker: Sequence[Sequence[Piece]], batch_size: int, rotation: int) -> list[list[int]]:
    """Each worker's pieces' places in the rank's fetch order: by the rank's batch that first needs
    them (DataLoader takes one batch from each worker in turn, from process 0, which plays logical
    worker ``rotation``), then by worker, then in the worker's own order.

    Except the first round (each worker's first batch), fetched last worker first: the trainer asks
    for the second batch one step after the first, too soon for the link to bring it, so the first
    batch comes with the whole round instead of before it (a longer first wait, no stall after)."""
    nw = len(per_worker)

    def turn(p: Piece, w: int) -> int:
        order = (w - rotation) % nw
        return nw - 1 - order if p.need < batch_size else order

    keys = [((p.need // batch_size, turn(p, w), k), w, k) for w, pieces in enumerate(per_worker) for k, p in enumerate(pieces)]
    keys.sort()
    out: list[list[int]] = [[0] * len(p) for p in per_worker]
    for g, (_, w, k) in enumerate(keys):
        out[w][k] = g
    return out


@dataclass(frozen=True)
class RankPieces:
    """One iteration of a rank, per logical worker: its pieces (after its skip), their places in the
    rank's fetch order, and its stream of (shard, index) per sample. The same in every process."""

    workers: list[WorkerPieces]
    places: list[list[int]]
    streams: list[tuple[np.ndarray, np.ndarray]]

    def sizes(self) -> list[int]:
        """Bytes of each piece, by its place in the rank's fetch order."""
        out = [0] * sum(len(p) for p in self.places)
        for wp, pl in zip(self.workers, self.places, strict=True):
            for p, g in zip(wp.pieces, pl, strict=True):
                out[g] = p.length
        return out

    def first_round(self, batch_size: int) -> int:
        """Pieces that every worker's first batch needs (they all go at once: ``rank_order``)."""
        return sum(1 for wp in self.workers for p in wp.pieces if p.need < batch_size)


def rank_pieces(
    counts: Sequence[int],
    cmap: ChunkMap,
    layout: Layout,
    epoch: int,
    skips: Sequence[int],
    rotation: int,
    segments: Sequence[Segment] = (),
) -> RankPieces:
    """The pieces of every logical worker of a rank (``layout.num_workers`` of them), each after
    skipping the samples ``skips`` says it already delivered, and the rank's fetch order of them;
    after ``segments`` (an epoch resumed on another world), of the rank's stripe of the epoch's rest."""
    plan = epoch_plan(counts, epoch, layout, segments)
    workers, streams = [], []
    for w, skip in enumerate(skips):
        shards, idx = plan.worker_stream(w, layout, epoch)
        need = np.maximum(need_positions(len(shards), layout)[skip:], skip) - skip
        workers.append(worker_pieces(shards[skip:], idx[skip:], need, cmap))
        streams.append((shards[skip:], idx[skip:]))
    return RankPieces(workers, rank_order([p.pieces for p in workers], layout.batch_size, rotation), streams)
