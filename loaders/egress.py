"""``EgressCounter``: the bytes one rank read from other regions' buckets, the one count its egress
budget is held against.

The count lives in memory shared with the DataLoader workers the rank forks (or spawns: it
travels with them as they start), so the rank's workers, and the next epoch's, add to the same
number; a checkpoint saves it with the loader's position and a resume restores it
(``RegionalLoader.state_dict``). A read reserves its bytes before it starts (compare and add under
the counter's lock), so workers reading at once cannot together pass the budget; a read that
fails gives its reservation back.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext
from typing import Any

from geoshard.errors import DataError

MAX_BYTES = 2**63 - 1  # what the shared signed 64-bit count holds


class EgressCounter:
    def __init__(self, used: int = 0, context: BaseContext | None = None) -> None:
        ctx = context or multiprocessing.get_context()
        self._value: Any = ctx.Value("q", check_count(used, "egress count"))

    @property
    def used(self) -> int:
        """Bytes read (and reserved by reads under way)."""
        with self._value.get_lock():
            return int(self._value.value)

    def reserve(self, nbytes: int, budget: int | None) -> int | None:
        """Add ``nbytes`` unless that passes ``budget`` (None: no cap): the count before the
        reservation, or None (nothing added) when it would pass."""
        with self._value.get_lock():
            used = int(self._value.value)
            if budget is not None and used + nbytes > budget:
                return None
            self._value.value = min(MAX_BYTES, used + nbytes)
            return used

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose read failed."""
        with self._value.get_lock():
            self._value.value = max(0, int(self._value.value) - nbytes)

    def restore(self, used: int) -> None:
        """Continue from a saved count (a resume), before the workers start."""
        with self._value.get_lock():
            self._value.value = check_count(used, "egress count")

    def moved_to(self, context: BaseContext) -> EgressCounter:
        """The same count in memory made by ``context`` (a DataLoader's ``multiprocessing_context``:
        a lock made for fork cannot travel to a spawned worker)."""
        return EgressCounter(self.used, context)


def check_count(value: Any, where: str) -> int:
    """``value`` as a byte count read back from a file; DataError naming ``where`` unless it is an
    integer from 0 to 2^63-1."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_BYTES:
        raise DataError(f"{where}: {value!r} is not a byte count (an integer from 0 to 2^63-1)")
    return value
