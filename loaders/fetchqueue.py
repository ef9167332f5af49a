"""One fetch order per rank, shared by its DataLoader workers.

Each worker fetches its own pieces of shards (``pieces.py``), but they all cross the same link.
Left alone, every worker starts its read-ahead at once and the piece the first batch needs shares
the link with all the others. So the training process lays out the rank's pieces in the order
its batches need them (worker 0's first, worker 1's first, worker 0's second, ...) and maps one
counter per piece, the bytes still to arrive, into memory shared with the workers it forks (as
``slots.py`` does for batches). A piece may start once the pieces before it have less than
``lead_bytes`` left to arrive: requests follow one another closely enough to hide the round trip,
and the first batch's bytes never wait behind read-ahead. The rank's first round (each worker's
first batch: the first batch is served with it, ``pieces.rank_order``) goes at once, all its
requests in flight together, so it pays one round trip, not one per piece.

The wait is bounded (``timeout_s``, then the piece goes anyway), and a queue that did not travel
by fork (``multiprocessing_context="spawn"``) or whose layout does not match lets pieces go at once.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
LEAD_BYTES = 256 << 10  # about one round trip's worth at a few MB/s
TIMEOUT_S = 60.0


class FetchQueue:
    def __init__(self, sizes: Sequence[int], lead_bytes: int = LEAD_BYTES, timeout_s: float = TIMEOUT_S, free: int = 0) -> None:
        self.size = len(sizes)
        self.free = free  # the first pieces all go at once (the rank's first round: see pieces.rank_order)
        self.lead_bytes, self.timeout_s = lead_bytes, timeout_s
        self._map: mmap.mmap | None = mmap.mmap(-1, max(8, 8 * self.size))
        self._left = np.frombuffer(self._map, dtype=np.int64, count=self.size)
        self._left[:] = np.asarray(sizes, dtype=np.int64)
        self._low = 0  # pieces before this one are all in (a hint, per process)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (a spawned worker): the mapping does not travel; such workers do not wait.
        return {"size": self.size, "free": self.free, "lead_bytes": self.lead_bytes, "timeout_s": self.timeout_s, "_map": None, "_low": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def usable(self) -> bool:
        return self._map is not None

    def wait_turn(self, piece: int, stop: threading.Event) -> bool:
        """Block until ``piece`` may start; False if it goes without its turn (stopped, or timed out)."""
        if self._map is None or not self.free <= piece < self.size:
            return True
        left = self._left
        deadline = time.monotonic() + self.timeout_s
        while True:
            low = self._low
            while low < piece and left[low] == 0:
                low += 1
            self._low = max(self._low, low)
            if int(left[low:piece].sum()) <= self.lead_bytes:
                return True
            if stop.is_set():
                return False
            if time.monotonic() > deadline:
                log.debug("fetch piece %d: earlier pieces still pending after %.0f s; fetching anyway", piece, self.timeout_s)
                return False
            stop.wait(0.004)

    def arrived(self, piece: int, nbytes: int) -> None:
        """``nbytes`` more of ``piece`` are in (only the thread fetching it calls this)."""
        if self._map is not None and 0 <= piece < self.size:
            self._left[piece] = max(0, int(self._left[piece]) - nbytes)

    def done(self, piece: int) -> None:
        """``piece`` is in, or failed: it holds no one back any more."""
        if self._map is not None and 0 <= piece < self.size:
            self._left[piece] = 0

    def pending(self) -> int:
        return int(self._left.sum()) if self._map is not None else 0
