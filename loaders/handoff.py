"""What passes between a ``RegionalDataset``'s consumer and its DataLoader workers: the start of an
iteration (``EpochStart``, taken by the workers when they fork), a geoshard error coming back
(``WorkerFailure``), and how far the consumer got (``Consumption``: the counts that ``state_dict``
saves and a resume skips).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geoshard.errors import ConfigError, GeoshardError
from geoshard.loaders.elastic import Segment


class WorkerFailure:
    """A geoshard error raised in a DataLoader worker, carried to the training process intact."""

    def __init__(self, error: GeoshardError) -> None:
        self.error = error


@dataclass(frozen=True)
class EpochStart:
    """How an iteration begins: the epoch, the samples each logical worker skips (a resume), which
    logical worker each DataLoader worker process plays first, and whether items carry the worker's
    identity and counters (``RegionalLoader``'s iterations) or are plain."""

    epoch: int
    skips: tuple[int, ...]
    rotation: int = 0
    tagged: bool = False
    slots: Any = None  # a SlotPool shared with the training process, for TensorSpec batches (slots.py)
    slot_tag: int = 0  # this iteration's mark on the slots its workers fill
    fetch_queue: Any = None  # the rank's fetch order, shared by the workers it forks (fetchqueue.py)
    segments: tuple[Segment, ...] = ()  # the epoch's earlier segments (elastic.py): this iteration reads their rest

    @classmethod
    def fresh(cls, epoch: int, num_workers: int, tagged: bool = False) -> EpochStart:
        """An epoch from its beginning: nothing skipped, no rotation."""
        return cls(epoch, (0,) * num_workers, 0, tagged)

    @property
    def num_workers(self) -> int:
        return len(self.skips)


class Consumption:
    """Samples of the current epoch handed to the consumer, per logical worker, and which worker's
    item comes next (DataLoader takes them round-robin); the epoch's earlier segments when it was
    resumed on another world (``elastic.py``); a loaded state is where the next iteration begins."""

    def __init__(self) -> None:
        self.consumed = [0]
        self.next_worker = 0
        self.segments: tuple[Segment, ...] = ()
        self._resume: tuple[list[int] | None, int] | None = None

    def restore(self, consumed: list[int] | None, next_worker: int, segments: tuple[Segment, ...] = ()) -> None:
        """The next iteration begins at ``consumed`` in the segment after ``segments``, or (None)
        at that segment's start, with any number of workers."""
        self.consumed, self.next_worker, self.segments = list(consumed or [0]), next_worker, segments
        self._resume = (None if consumed is None else list(consumed), next_worker)

    def begin(self, epoch: int, num_workers: int, tagged: bool) -> EpochStart:
        """The start of an iteration of ``epoch``: where a restored state left off, or from zero."""
        if self._resume is not None:
            skip, rotation = self._resume
            self._resume = None
            if skip is None:
                self.consumed, self.next_worker = [0] * num_workers, 0
                skip = self.consumed
            elif len(skip) != num_workers:
                raise ConfigError(
                    f"loader state was saved with {len(skip)} DataLoader worker(s); resume with the same number, not {num_workers}"
                )
            return EpochStart(epoch, tuple(skip), rotation, tagged, segments=self.segments)
        self.consumed, self.next_worker, self.segments = [0] * num_workers, 0, ()
        return EpochStart.fresh(epoch, num_workers, tagged)

    def record(self, worker: int, samples: int) -> None:
        self.consumed[worker] += samples
        self.next_worker = (worker + 1) % len(self.consumed)

    def items(self, batch_size: int) -> int:
        """Items handed over so far, with ``batch_size`` samples per item (1: unbatched)."""
        return sum(-(-c // batch_size) for c in self.consumed)
