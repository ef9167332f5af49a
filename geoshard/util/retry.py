"""Retries with exponential backoff and jitter, as a pure function of its parameters.

The delay before retry ``i`` (0-based) is ``min(cap, base * factor**i)``, multiplied by a
uniform factor in ``[1 - jitter, 1 + jitter]`` drawn from the ``rng`` passed in, so tests can
fix the draws and assert the exact delays (the shape of dask's ``utils_comm.retry``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    attempts: int = 4  # total tries, the first included
    base: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 0.25
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base < 0 or self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError("Backoff needs attempts >= 1, base >= 0, factor >= 1 and 0 <= jitter < 1")

    def delays(self) -> Iterator[float]:
        """The ``attempts - 1`` waits between tries."""
        for i in range(self.attempts - 1):
            d = min(self.cap, self.base * self.factor**i)
            yield d * self.rng.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else d


def retry(
    fn: Callable[[], T],
    backoff: Backoff,
    retry_on: tuple[type[BaseException], ...],
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` until it returns, retrying ``retry_on`` errors with ``backoff``'s delays."""
    delays = backoff.delays()
    while True:
        try:
            return fn()
        except retry_on as e:
            delay = next(delays, None)
            if delay is None:
                raise
            log.warning("%s failed (%s); retrying in %.2f s", what, e, delay)
            sleep(delay)
