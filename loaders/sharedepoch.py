"""A dataset's epoch in memory shared with the DataLoader workers it starts.

torch's own ``DataLoader(..., persistent_workers=True)`` starts its workers once, with a copy of
the dataset: an epoch set afterwards in the training process would never reach them, and every
epoch would repeat the first one's order. The workers read the epoch from here at each
iteration's start instead. The value travels with the workers (fork, spawn or forkserver); any
other copy of the dataset (``copy.deepcopy``, a pickle) gets a value of its own.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import get_spawning_popen
from typing import Any


class SharedEpoch:
    def __init__(self, value: int = 0) -> None:
        self._value: Any = multiprocessing.RawValue("q", value)

    @property
    def value(self) -> int:
        return int(self._value.value)

    @value.setter
    def value(self, epoch: int) -> None:
        self._value.value = epoch

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory may only be handed to a process being started (multiprocessing refuses
        # it otherwise); anything else copies the number.
        return {"shared": self._value} if get_spawning_popen() is not None else {"value": self.value}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._value = state["shared"] if "shared" in state else multiprocessing.RawValue("q", state["value"])
