"""One logical worker's samples of an epoch, in order, from its pieces of shards (``pieces.py``).

``PieceFetcher`` fetches one piece through the chain, taking its turn in the rank's fetch order
(``fetchqueue.py``); ``WorkerReader`` prefetches the pieces in the order the stream needs them
(``prefetch.py``) and cuts the stream's samples out of them, letting each piece go after its
last sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from geoshard.formats import format_spec
from geoshard.loaders.chain import TierChain
from geoshard.loaders.decode import apply
from geoshard.loaders.fetchqueue import FetchQueue
from geoshard.loaders.pieces import Piece, WorkerPieces, key
from geoshard.loaders.prefetch import Prefetcher
from geoshard.loaders.shard import Shard
from geoshard.loaders.tier import Progress
from geoshard.manifest import RegionManifest


class PieceFetcher:
    """Fetches a worker's pieces (by their index in its list) as ``Shard``s; with a fetch queue,
    each waits for its ``place`` in the rank's order and reports its bytes as they arrive."""

    def __init__(
        self, chain: TierChain, manifest: RegionManifest, pieces: list[Piece], place: list[int], queue: FetchQueue | None, copy: bool
    ) -> None:
        self.chain, self.manifest, self.pieces, self.place, self.queue, self.copy = chain, manifest, pieces, place, queue, copy
        self.prefetcher: Prefetcher[Shard] | None = None  # the one calling this (WorkerReader sets it): its stop ends a wait

    def __call__(self, k: int) -> Shard:
        g, q = self.place[k], self.queue
        if q is not None:
            assert self.prefetcher is not None
            q.wait_turn(g, self.prefetcher.stopped)
        try:
            return self._fetch(self.pieces[k], (lambda n: q.arrived(g, n)) if q is not None else None)
        finally:
            if q is not None:
                q.done(g)

    def _fetch(self, p: Piece, progress: Progress | None) -> Shard:
        entry, fmt = self.chain.with_chunks(self.manifest.shards[p.shard]), self.manifest.format
        if not p.chunked:
            return Shard(entry.path, self.chain.fetch(entry), fmt, copy=self.copy, expected=entry.samples)
        data = self.chain.fetch_chunks(entry, p.first, p.last, progress)
        assert entry.chunks is not None
        end = format_spec(fmt).trailer  # a piece that ends before the shard does gets the end to parse alone
        if end and p.last < len(entry.chunks.bytes) - 1:
            data = b"".join((data, end))
        return Shard(entry.path, data, fmt, copy=self.copy, expected=sum(entry.chunks.samples[p.first : p.last + 1]))


class WorkerReader:
    """The samples of one worker's stream (``shards``/``indices`` per sample), decoded, each with
    the path of its shard (for errors); ``close()`` stops the prefetch threads."""

    def __init__(
        self,
        fetcher: PieceFetcher,
        mine: WorkerPieces,
        stream: tuple[np.ndarray, np.ndarray],
        depth: int,
        decoder: Callable[[Any], Any] | None,
    ) -> None:
        self.mine, self.decoder = mine, decoder
        self.shards, self.indices = stream[0].tolist(), stream[1].tolist()
        pieces = mine.pieces
        self.prefetcher = Prefetcher(fetcher, list(range(len(pieces))), depth, [p.ordinal for p in pieces])
        fetcher.prefetcher = self.prefetcher

    def __len__(self) -> int:
        return len(self.shards)

    def samples(self) -> Iterator[tuple[Any, str]]:
        pieces, last_use, decoder = self.mine.pieces, self.mine.last_use, self.decoder
        open_chunks: dict[int, tuple[Shard, int]] = {}  # key(shard, chunk) -> (its piece's Shard, the piece's first sample)
        loaded = 0  # pieces taken from the prefetcher so far
        for i, (s, j, c) in enumerate(zip(self.shards, self.indices, self.mine.chunks.tolist(), strict=True)):
            k = key(s, c)
            got = open_chunks.get(k)
            while got is None:  # the next pieces in order, up to the one holding this sample
                p, piece = pieces[loaded], self.prefetcher.get(loaded)
                loaded += 1
                for cc in range(p.first, p.last + 1):
                    open_chunks[key(p.shard, cc)] = (piece, p.sample0)
                got = open_chunks.get(k)
            shard, base = got
            item = shard.sample(j - base)
            if decoder is not None:
                item = apply(decoder, item, shard.path)
            if last_use[k] == i:
                del open_chunks[k]  # its last sample this epoch: let the memory go
            yield item, shard.path

    def close(self) -> None:
        self.prefetcher.close()
