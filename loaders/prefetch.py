"""Background fetching of what a worker will need, in the order it will need it.

The order is known before the epoch starts (see ``epoch.py`` and ``pieces.py``), so prefetching
is exact: items (shards, or pieces of shards) are fetched on ``depth`` threads, up to ``depth``
shards ahead of the one being consumed (``ordinal`` says which shard each item belongs to; by
default each item is a shard of its own). File reads, S3 GETs and hashing release the GIL, so
fetching overlaps the consumer's Python work. The threads are daemons: one waiting for its turn
on the link (``fetchqueue.py``) never holds a worker process that is ending.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Prefetcher(Generic[T]):
    def __init__(self, fetch: Callable[[int], T], order: Sequence[int], depth: int, ordinal: Sequence[int] | None = None) -> None:
        self._fetch = fetch
        self._order = list(order)  # keys by first use
        self._ordinal = list(ordinal) if ordinal is not None else list(range(len(self._order)))
        self._pos = {s: i for i, s in enumerate(self._order)}
        self._depth = depth
        self._jobs: queue.SimpleQueue[tuple[Future[T], int] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._futures: dict[Hashable, Future[T]] = {}
        self._submitted = 0  # positions of _order submitted so far
        self.stopped = threading.Event()  # set by close(): fetches waiting for their turn give up

    def get(self, key: int) -> T:
        """The fetched item; blocks until it is there. Each item is asked for once."""
        if self._depth <= 0:
            return self._fetch(key)
        self._submit_through(self._ordinal[self._pos[key]] + self._depth)
        return self._futures.pop(key).result()

    def _submit_through(self, last_ordinal: int) -> None:
        if not self._threads:
            for i in range(self._depth):
                t = threading.Thread(target=self._run, name=f"geoshard-prefetch-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        while self._submitted < len(self._order) and self._ordinal[self._submitted] <= last_ordinal:
            k = self._order[self._submitted]
            f: Future[T] = Future()
            self._futures[k] = f
            self._jobs.put((f, k))
            self._submitted += 1

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            f, k = job
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(self._fetch(k))
            except BaseException as e:  # handed to the consumer by result()
                f.set_exception(e)

    def close(self) -> None:
        self.stopped.set()
        for f in self._futures.values():
            f.cancel()
        self._futures.clear()
        for _ in self._threads:
            self._jobs.put(None)
