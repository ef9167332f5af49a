"""Your own training loop, measured the way ``geoshard train`` measures its own: ``StepLog`` wraps
the loader in ``timed(loader)`` and writes the step log and rank summary ``geoshard report`` reads.

    from geoshard.loaders import make_loader
    from geoshard.trainer.steplog import StepLog

    loader = make_loader("plan.toml", region="eu-west-1", batch_size=64, num_workers=4)
    with StepLog("runs/mine", loader) as steps:         # RUN_DIR; rank and world size from torch.distributed
        for batch in steps.stream(max_steps=1000):    # epoch after epoch, no stall at the boundaries
            loss = train_step(model, batch)
            steps.note(loss=loss)                     # optional: the loss in the report (a tensor is fine)
    # then: geoshard report runs/mine [--fail-over-budget]

``for batch in steps`` is one epoch of the loader instead. The time blocked in ``next(loader)`` is
the step's data wait; the time from handing out the batch to asking for the next one (or to leaving
the loop, or closing the log) is its compute (your forward, backward and optimizer step).

A folder that holds another run is refused (``runclaim.py``); ``resume=True`` appends to the run
there, as a new segment whose steps count on from its last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from geoshard.errors import ConfigError
from geoshard.loaders.loader import Timed
from geoshard.trainer.record import StepRecord, append_step
from geoshard.trainer.runclaim import claim
from geoshard.trainer.runlog import RunLogs
from geoshard.trainer.summary import LoaderSummary, RankSummary


@dataclass(frozen=True)
class _Handed:
    """A batch handed out whose step is not recorded yet: what it waited and when it left."""

    wait: float
    at: float
    samples: int


class StepLog:
    def __init__(
        self,
        run_dir: str | Path,
        loader: Iterable[Any],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        region: str | None = None,
        samples_of: Callable[[Any], int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        resume: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.loader = loader
        self.timed: Timed = Timed(loader, clock)
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        dataset = getattr(loader, "dataset", None)
        self.region = region or getattr(dataset, "region", None)
        self.samples_of = samples_of or batch_size
        self.clock = clock
        self.run_id = claim(self.run_dir, self.rank, self.world_size, resume)
        self.logs = RunLogs(self.run_dir, self.rank)
        self.step = self.logs.last_step() if resume else 0  # the step in hand (or the last one recorded)
        self._first_step = self.step
        self.segment = self.logs.start_segment(self.step)
        self.path = self.logs.steps
        self.file = self.logs.open_steps()
        self.started = clock()
        self.samples = 0
        self.first_batch: float | None = None
        self._loss: Any = None
        self._handed: _Handed | None = None

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def note(self, *, loss: Any = None) -> None:
        """Attach the loss to the current step: a number, or a tensor (detached, read when the step
        is recorded)."""
        detach = getattr(loss, "detach", None)
        self._loss = detach() if callable(detach) else loss

    def __iter__(self) -> Iterator[Any]:
        """One pass over the loader (an epoch); each batch handed out is one step of the log."""
        return self._steps(self.timed, None)

    def stream(self, max_steps: int | None = None) -> Iterator[Any]:
        """Batches epoch after epoch (the loader's ``stream()``: the next epoch's workers start before
        this one ends), until the run's step ``max_steps`` (without end: None)."""
        stream = getattr(self.loader, "stream", None)
        if not callable(stream):
            raise ConfigError("StepLog.stream() needs a loader with stream(): make_loader(...) (a RegionalLoader)")
        return self._steps(Timed(stream(), self.clock), max_steps)

    def _steps(self, timed: Timed, max_steps: int | None) -> Iterator[Any]:
        it = iter(timed)
        try:
            while max_steps is None or self.step < max_steps:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                handed = self.clock()
                if self.first_batch is None:
                    self.first_batch = handed - self.started
                self.step += 1
                self._loss = None
                self._handed = _Handed(timed.waits[-1], handed, self.samples_of(batch))
                yield batch
                self._record()
        finally:  # a loop left with break or an exception: its last step is recorded here
            self._record()

    def _record(self) -> None:
        """Write the step in hand: it ends now."""
        handed, self._handed = self._handed, None
        if handed is None or self.file.closed:
            return
        loss = None if self._loss is None else float(self._loss)  # waits for the step's device work
        done = self.clock()
        self.samples += handed.samples
        record = StepRecord(
            step=self.step,
            rank=self.rank,
            t=done - self.started,
            data_wait_s=handed.wait,
            compute_s=done - handed.at,
            step_s=handed.wait + done - handed.at,
            loss=loss,
            samples=handed.samples,
            region=self.region,
            segment=self.segment,
        )
        append_step(self.file, record)

    def close(self) -> None:
        """Record the step in hand and write the rank summary (RUN_DIR/rank{R}.json): the run is
        then complete for the report."""
        if self.file.closed:
            return
        self._record()
        self.file.close()
        stats = getattr(self.loader, "stats", None)
        summary = RankSummary(
            rank=self.rank,
            world_size=self.world_size,
            region=self.region,
            wall_s=self.clock() - self.started,
            time_to_first_batch_s=self.first_batch if self.first_batch is not None else 0.0,
            steps=self.step - self._first_step,
            samples=self.samples,
            loader=LoaderSummary.from_json(stats(), "the loader's stats") if callable(stats) else None,
        )
        self.logs.finish(summary, self.segment)


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of a tensor or array, the length of a list, or of
    a dict's first value (a collated batch)."""
    if isinstance(batch, dict) and batch:
        batch = next(iter(batch.values()))
    shape = getattr(batch, "shape", None)
    if shape:
        return int(shape[0])
    try:
        return len(batch)
    except TypeError:
        return 1


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None:
        return rank, world_size or 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return 0, world_size or 1
