"""The split's tasks on Dask's threaded scheduler, in threads of the command's own process.

The default for local sources: ``dask.threaded.get`` is Dask's local scheduler (the one
``dask.compute(..., scheduler="threads")`` uses), so the command imports ``dask`` but not
``distributed``, whose import alone is a noticeable share of a split's start, and starts no
cluster. The tasks' reads, writes and hashes release the GIL (docs/benchmarks.md). Progress goes straight to
the driver's callback; a failed task, or Ctrl-C, stops the others at their next read window
before the caller removes the temporary folder.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import dask.threaded

from geoshard.split.task import GroupResult, GroupTask, ProgressFn, TaskFailed, run_group_task


class Abandoned(Exception):
    """Raised inside a task whose split was abandoned; nothing reads it."""


class _Report:
    """The tasks' :class:`~geoshard.split.task.Reporter`: progress to the driver, and the stop flag."""

    def __init__(self, progress: ProgressFn | None) -> None:
        self.progress = progress
        self.stop = threading.Event()

    def event(self, counts: dict[str, int]) -> None:
        if self.progress is not None:
            self.progress(counts)  # the driver's callback is thread-safe (job._serialized)

    def check(self) -> None:
        if self.stop.is_set():
            raise Abandoned


class ThreadedRunner:
    """Runs split tasks through ``dask.threaded.get`` on a pool of ``workers`` threads."""

    def __init__(self, pool: ThreadPoolExecutor, report: _Report) -> None:
        self.pool = pool
        self.report = report

    def run(self, tasks: Sequence[GroupTask], on_result: Callable[[GroupResult], None]) -> None:
        """Every task once; ``on_result`` in this thread as each ends. The first failure raises
        here (its error); the tasks still running stop at their next tick once the runner's block ends."""
        graph = {f"geoshard-split-{t.group}": (functools.partial(run_group_task, t, self.report),) for t in tasks}

        def finished(key: str, res: GroupResult | TaskFailed, dsk: Any, state: Any, worker_id: Any) -> None:
            if isinstance(res, TaskFailed):
                raise res.error
            on_result(res)

        dask.threaded.get(graph, list(graph), pool=self.pool, callbacks=[(None, None, None, finished, None)])

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One task of ``fn(*args)`` on the same scheduler and pool."""
        return dask.threaded.get({"geoshard-split-call": (functools.partial(fn, *args),)}, "geoshard-split-call", pool=self.pool)


@contextmanager
def threaded_runner(workers: int | None, progress: ProgressFn | None) -> Iterator[ThreadedRunner]:
    """A runner whose threads are all stopped and joined when the block ends, also on errors and
    Ctrl-C: no task writes into the temporary folder after the caller has removed it."""
    report = _Report(progress)
    pool = ThreadPoolExecutor(max_workers=workers or len(os.sched_getaffinity(0)), thread_name_prefix="geoshard-split")
    try:
        yield ThreadedRunner(pool, report)
    finally:
        report.stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
