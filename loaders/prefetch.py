"""Background fetching of the shards a worker will need, in the order it will need them.

The order is known before the epoch starts (see ``epoch.py``), so prefetching is exact: at most
``depth`` shards are fetched or held ahead of the one being consumed, on ``depth`` threads. File
reads, S3 GETs and sha256 release the GIL, so fetching overlaps the consumer's Python work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Prefetcher(Generic[T]):
    def __init__(self, fetch: Callable[[int], T], order: Sequence[int], depth: int) -> None:
        self._fetch = fetch
        self._order = list(order)  # shard ids by first use
        self._pos = {s: i for i, s in enumerate(self._order)}
        self._depth = depth
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="geoshard-prefetch") if depth > 0 else None
        self._futures: dict[int, Future[T]] = {}
        self._submitted = 0  # positions of _order submitted so far

    def get(self, shard: int) -> T:
        """The fetched shard; blocks until it is there. Each shard is asked for once."""
        if self._pool is None:
            return self._fetch(shard)
        self._submit_through(self._pos[shard] + self._depth)
        return self._futures.pop(shard).result()

    def _submit_through(self, last: int) -> None:
        assert self._pool is not None
        while self._submitted <= min(last, len(self._order) - 1):
            s = self._order[self._submitted]
            self._futures[s] = self._pool.submit(self._fetch, s)
            self._submitted += 1

    def close(self) -> None:
        for f in self._futures.values():
            f.cancel()
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
