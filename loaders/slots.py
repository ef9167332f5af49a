"""Batches from forked DataLoader workers to the training process through shared memory, without
pickling their bytes or creating a segment per batch.

The training process maps one anonymous shared region (``mmap(-1, n)``: ``MAP_SHARED``) before it
forks the workers, which inherit it. The region is cut into fixed-size slots. A worker takes a
free slot, decodes a batch straight into it (``decode.fill_batch``) and sends only the slot's
number and the arrays' layout through the DataLoader's queue. The training process wraps the
slot in numpy arrays and tensors (views, no copy); when the last of them is freed, a finalizer
marks the slot free again. So a batch stays valid as long as the consumer holds it, and steady
state touches no new pages on either side (a fresh segment per batch costs a page fault per 4 KB
on both sides: slower than pickling, measured in docs/benchmarks.md).

A slot's state byte holds 0 (free) or the tag of the iteration whose worker filled it; taking one
is a test-and-set under a lock shared by the forked processes. Slots of iterations that ended
without their batches being consumed are reclaimed when the next iteration starts. When no slot is
free (the consumer holds more batches than the pool has slots), or the workers were not forked
from this process (``multiprocessing_context="spawn"``), a batch travels pickled instead: slower,
never blocked.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

_PAGE = mmap.PAGESIZE


class SlotPool:
    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        self._header = -(-slots // _PAGE) * _PAGE
        self._map: mmap.mmap | None = mmap.mmap(-1, self._header + slots * self.slot_bytes)
        self._state = np.frombuffer(self._map, dtype=np.uint8, count=slots)
        self._lock = multiprocessing.get_context("fork").Lock()
        self._owner = os.getpid()
        self._held: set[int] = set()  # slots the training process has opened and not released
        self._held_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (a spawned worker): the mapping does not travel; such workers send batches pickled.
        return {"slots": self.slots, "slot_bytes": self.slot_bytes, "_map": None, "_owner": -1}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def usable(self) -> bool:
        return self._map is not None

    # -- worker side ------------------------------------------------------------------------
    def acquire(self, tag: int, nbytes: int) -> int:
        """A free slot for a batch of ``nbytes``, marked with the iteration ``tag`` (1-255); -1 if none."""
        if self._map is None or nbytes > self.slot_bytes:
            return -1
        state = self._state
        if not self._lock.acquire(timeout=1.0):  # a sibling died holding it: pickle this batch
            return -1
        try:
            free = np.flatnonzero(state == 0)
            if not len(free):
                return -1
            slot = int(free[0])
            state[slot] = tag
        finally:
            self._lock.release()
        return slot

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        assert self._map is not None
        start = self._header + slot * self.slot_bytes
        return memoryview(self._map)[start : start + nbytes]

    # -- training-process side ------------------------------------------------------------
    def open(self, slot: int, nbytes: int) -> np.ndarray:
        """The slot's bytes as a writable uint8 array; the slot is free again once it (and every
        view of it) is garbage."""
        assert self._map is not None
        base = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=self._header + slot * self.slot_bytes)
        with self._held_lock:
            self._held.add(slot)
        weakref.finalize(base, self._release, slot)
        return base

    def _release(self, slot: int) -> None:
        with self._held_lock:
            self._held.discard(slot)
        self._state[slot] = 0

    def reclaim(self, live_tags: Iterable[int]) -> int:
        """Free slots filled by iterations no longer running whose batches nobody holds; how many."""
        if self._map is None:
            return 0
        live = set(live_tags)
        n = 0
        if not self._lock.acquire(timeout=1.0):
            return 0
        try:
            with self._held_lock:
                for slot in np.flatnonzero(self._state).tolist():
                    if int(self._state[slot]) not in live and slot not in self._held:
                        self._state[slot] = 0
                        n += 1
        finally:
            self._lock.release()
        return n

    def free_slots(self) -> int:
        return int((self._state == 0).sum()) if self._map is not None else 0
