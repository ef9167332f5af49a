"""Your own training loop, measured the way ``geoshard train`` measures its own: ``StepLog`` wraps
the loader in ``timed(loader)`` and writes the step log and rank summary ``geoshard report`` reads.

    from geoshard.loaders import make_loader
    from geoshard.trainer.steplog import StepLog

    loader = make_loader("plan.toml", region="eu-west-1", batch_size=64, num_workers=4)
    with StepLog("runs/mine", loader) as steps:         # RUN_DIR; rank and world size from torch.distributed
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in steps:                           # one optimizer step per batch
                loss = train_step(model, batch)
                steps.note(loss=float(loss))              # optional: the loss in the report
    # then: geoshard report runs/mine [--fail-over-budget]

The time blocked in ``next(loader)`` is the step's data wait; the time from handing out the batch
to asking for the next one is its compute (your forward, backward and optimizer step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from geoshard.loaders.loader import Timed, timed
from geoshard.trainer.record import StepRecord, append_step
from geoshard.trainer.summary import LoaderSummary, RankSummary, write_summary


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
    ) -> None:
        self.run_dir = Path(run_dir)
        self.loader = loader
        self.timed: Timed = timed(loader)
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        dataset = getattr(loader, "dataset", None)
        self.region = region or getattr(dataset, "region", None)
        self.samples_of = samples_of or batch_size
        self.clock = clock
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / f"steps-rank{self.rank}.jsonl"
        self.file = open(self.path, "w")  # noqa: SIM115 - closed by close()
        self.started = clock()
        self.step = 0
        self.samples = 0
        self.first_batch: float | None = None
        self._loss: float | None = None

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def note(self, *, loss: float | None = None) -> None:
        """Attach the loss to the current step (call it before asking for the next batch)."""
        self._loss = loss

    def __iter__(self) -> Iterator[Any]:
        """One pass over the loader (an epoch); each batch handed out is one step of the log."""
        it = iter(self.timed)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            handed = self.clock()
            wait = self.timed.waits[-1]
            if self.first_batch is None:
                self.first_batch = handed - self.started
            self._loss = None
            yield batch
            done = self.clock()
            self.step += 1
            n = self.samples_of(batch)
            self.samples += n
            record = StepRecord(
                step=self.step,
                rank=self.rank,
                t=done - self.started,
                data_wait_s=wait,
                compute_s=done - handed,
                step_s=wait + done - handed,
                loss=self._loss,
                samples=n,
                region=self.region,
            )
            append_step(self.file, record)

    def close(self) -> None:
        """Write the rank summary (RUN_DIR/rank{R}.json): the run is then complete for the report."""
        if self.file.closed:
            return
        self.file.close()
        stats = getattr(self.loader, "stats", None)
        summary = RankSummary(
            rank=self.rank,
            world_size=self.world_size,
            region=self.region,
            wall_s=self.clock() - self.started,
            time_to_first_batch_s=self.first_batch if self.first_batch is not None else 0.0,
            steps=self.step,
            samples=self.samples,
            loader=LoaderSummary.from_json(stats(), "the loader's stats") if callable(stats) else None,
            segment=0,
        )
        write_summary(self.run_dir, summary)


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
