"""The split's tasks on a ``distributed`` cluster: ``--scheduler``, or an in-process
``LocalCluster`` of worker processes (``--processes``, sources on S3).

Imported only on those paths: ``distributed`` takes 0.3-0.4 s to import, which the default
threaded path (geoshard/split/threaded.py) does without."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from distributed import Client, LocalCluster, as_completed

from geoshard.errors import ConfigError
from geoshard.split.task import PROGRESS_TOPIC, GroupResult, GroupTask, ProgressFn, TaskFailed, run_group_task


class ClusterRunner:
    """Runs split tasks as futures of a ``distributed`` client; progress through Dask events."""

    def __init__(self, client: Client, progress: ProgressFn | None) -> None:
        self.client = client
        self.progress = progress

    def run(self, tasks: Sequence[GroupTask], on_result: Callable[[GroupResult], None]) -> None:
        """Every task once; ``on_result`` in this thread as each ends. The first failure raises
        here (its error) and cancels the rest."""
        client, progress = self.client, self.progress
        if progress is not None:
            client.subscribe_topic(PROGRESS_TOPIC, lambda event: progress(event[1]))
        keys = [f"geoshard-split-{t.group}-{os.getpid()}-{time.time_ns()}" for t in tasks]
        futures = client.map(run_group_task, tasks, pure=False, key=keys)
        try:
            for fut in as_completed(futures):
                res: GroupResult | TaskFailed = fut.result()
                if isinstance(res, TaskFailed):
                    raise res.error
                on_result(res)
        except BaseException:
            client.cancel(futures)
            raise
        finally:
            if progress is not None:
                client.unsubscribe_topic(PROGRESS_TOPIC)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One task of ``fn(*args)`` on the cluster."""
        return self.client.submit(fn, *args, pure=False).result()


@contextmanager
def cluster_runner(scheduler: str | None, workers: int | None, progress: ProgressFn | None) -> Iterator[ClusterRunner]:
    """A client of the ``--scheduler`` cluster, else of an in-process ``LocalCluster`` with one
    worker process per ``workers`` (default: per core), as a remote cluster would have."""
    if scheduler:
        try:
            client = Client(scheduler, timeout="10s")
        except (OSError, TimeoutError) as e:
            raise ConfigError(f"--scheduler {scheduler}: cannot connect to the Dask scheduler ({e})") from e
        with client:
            yield ClusterRunner(client, progress)
        return
    n = workers or len(os.sched_getaffinity(0))
    with (
        LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR) as cluster,
        Client(cluster) as client,
    ):
        yield ClusterRunner(client, progress)
