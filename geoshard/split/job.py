"""The split as a Dask job: list sources, group them, run one task per group, publish.

The driver only lists, schedules and publishes; workers read sources and write shards, so no
sample passes through the driver. The output folder is locked for the duration of a split.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError, DataError, LockedError
from geoshard.formats import Format
from geoshard.manifest import MANIFEST, Manifest, RegionManifest, RegionSummary, ShardEntry, SourceEntry, read_manifest
from geoshard.plan import Plan
from geoshard.routing import RouteSpec
from geoshard.sources import S3Access, expand_sources
from geoshard.split.groups import make_groups
from geoshard.split.publish import TMP, manifest_sha, publish
from geoshard.split.task import PROGRESS_TOPIC, GroupResult, GroupTask, find_key, run_group

log = logging.getLogger(__name__)
ProgressFn = Callable[[dict[str, int]], None]


@dataclass(frozen=True)
class SplitSettings:
    out: Path
    workers: int | None = None  # in-process LocalCluster size; None: one per core
    scheduler: str | None = None  # tcp://host:port of an existing cluster
    fmt: Format | None = None  # None: from file names / content
    s3: S3Access = field(default_factory=S3Access)
    replace: bool = False  # allow replacing a split of a different plan
    created: str | None = None  # fixed creation time (SOURCE_DATE_EPOCH) for reproducible manifests


@dataclass(frozen=True)
class SplitResult:
    manifest: Manifest
    regions: dict[str, RegionManifest]
    samples_in: int
    bytes_in: int
    seconds: float  # the whole split, from listing sources to publishing
    cluster_seconds: float = 0.0  # starting or connecting to the Dask cluster
    job_seconds: float = 0.0  # the tasks: from submission to the last result


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".geoshard.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockedError(f"{out}: another geoshard split or refresh is writing this folder; try again when it ends") from None
        yield


@contextmanager
def dask_client(settings: SplitSettings) -> Iterator[Any]:
    from distributed import Client, LocalCluster

    if settings.scheduler:
        try:
            client = Client(settings.scheduler, timeout="10s")
        except (OSError, TimeoutError) as e:
            raise ConfigError(f"--scheduler {settings.scheduler}: cannot connect to the Dask scheduler ({e})") from e
        with client:
            yield client
        return
    n = settings.workers or len(os.sched_getaffinity(0))
    with (
        LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR) as cluster,
        Client(cluster) as client,
    ):
        yield client


def run_split(sources: Sequence[str], plan: Plan, settings: SplitSettings, progress: ProgressFn | None = None) -> SplitResult:
    t0 = time.monotonic()
    out = settings.out
    _check_out(out, plan, settings.replace)  # fail before listing sources; checked again under the lock
    refs = expand_sources(sources, settings.fmt, settings.s3)
    fmt: Format = refs[0].format
    route = RouteSpec(plan, fmt)
    if plan.routing.key and fmt == "wds":
        log.info("routing.key applies to TFRecord only; WebDataset samples route by __key__")
    groups = make_groups(refs, plan)
    with _locked(out):
        previous = _check_out(out, plan, settings.replace)
        shutil.rmtree(out / TMP, ignore_errors=True)  # leftovers of an interrupted split
        tmpdir = out / TMP / f"run-{os.getpid()}-{int(time.time())}"
        tmpdir.mkdir(parents=True)
        try:
            tasks = [
                GroupTask(
                    group=i,
                    sources=g,
                    fmt=fmt,
                    route=route,
                    region_names=plan.region_names,
                    target_bytes=plan.shards.bytes,
                    target_samples=plan.shards.samples,
                    key_feature=plan.routing.key if fmt == "tfrecord" else None,
                    tmpdir=str(tmpdir.resolve()),
                    s3=settings.s3,
                )
                for i, g in enumerate(groups)
            ]
            results, timing = _run_tasks(tasks, settings, progress)
            manifest, regions = _manifests(plan, fmt, results, previous, settings)
            publish(out, tmpdir, manifest, regions)
        except BaseException:
            shutil.rmtree(out / TMP, ignore_errors=True)
            raise
    return SplitResult(
        manifest=manifest,
        regions=regions,
        samples_in=sum(r.samples_in for r in results),
        bytes_in=sum(r.size for r in refs),
        seconds=time.monotonic() - t0,
        cluster_seconds=timing[0],
        job_seconds=timing[1],
    )


def _check_out(out: Path, plan: Plan, replace: bool) -> Manifest | None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    if not (out / MANIFEST).exists():
        return None
    try:
        old = read_manifest(out)
    except DataError as e:
        raise ConfigError(f"--out {out}: holds an unreadable manifest ({e}); choose another folder") from e
    if old.layout_sha256 != plan.layout_sha256() and not replace:
        raise ConfigError(
            f"--out {out}: holds a split of a different plan (regions, weights, routing or shard size differ); "
            "choose a new folder or pass --replace"
        )
    return old


def _run_tasks(
    tasks: list[GroupTask], settings: SplitSettings, progress: ProgressFn | None
) -> tuple[list[GroupResult], tuple[float, float]]:
    from distributed import as_completed

    results: list[GroupResult] = []
    t0 = time.monotonic()
    with dask_client(settings) as client:
        t1 = time.monotonic()
        if progress is not None:
            client.subscribe_topic(PROGRESS_TOPIC, lambda event: progress(event[1]))
        futures = client.map(run_group, tasks, pure=False, key=[f"geoshard-split-{t.group}-{os.getpid()}-{time.time_ns()}" for t in tasks])
        try:
            for fut in as_completed(futures):
                res: GroupResult = fut.result()
                results.append(res)
                if progress is not None:
                    progress({"shards": len(res.shards)})
            t2 = time.monotonic()
            _check_duplicates(client, results, tasks)
        except BaseException:
            client.cancel(futures)
            raise
        finally:
            if progress is not None:
                client.unsubscribe_topic(PROGRESS_TOPIC)
    return sorted(results, key=lambda r: r.group), (t1 - t0, t2 - t1)


def _check_duplicates(client: Any, results: list[GroupResult], tasks: list[GroupTask]) -> None:
    """Each task rejects duplicates inside its group; this finds keys repeated across groups."""
    import numpy as np

    keyed = [r for r in results if r.key_hashes]
    if len(keyed) < 2:
        return
    arrays = [np.frombuffer(r.key_hashes, dtype=np.uint64) for r in keyed]
    owners = np.concatenate([np.full(len(a), r.group, dtype=np.int64) for a, r in zip(arrays, keyed, strict=True)])
    allh = np.concatenate(arrays)
    order = np.argsort(allh, kind="stable")
    sorted_h = allh[order]
    dup = np.flatnonzero(sorted_h[1:] == sorted_h[:-1])
    if len(dup) == 0:
        return
    i = int(dup[0])
    h = int(sorted_h[i])
    groups = (tasks[int(owners[order[i]])], tasks[int(owners[order[i + 1]])])
    # Only the 64-bit hash came back; a task finds the key and its sources for the message.
    found = client.submit(find_key, groups, h, pure=False).result()
    raise DataError(f"duplicate sample key {found[0]!r} in {' and '.join(found[1])}")


def _manifests(
    plan: Plan, fmt: Format, results: list[GroupResult], previous: Manifest | None, settings: SplitSettings
) -> tuple[Manifest, dict[str, RegionManifest]]:
    generation = (previous.generation + 1) if previous else 1
    plan_sha = plan.sha256()
    regions: dict[str, RegionManifest] = {}
    summaries: dict[str, RegionSummary] = {}
    for name in plan.region_names:
        shards = tuple(
            ShardEntry(path=s.name, samples=s.samples, bytes=s.bytes, sha256=s.sha256, group=s.group)
            for r in results
            for s in sorted(r.shards, key=lambda s: s.name)
            if s.region == name
        )
        rm = RegionManifest(region=name, format=fmt, generation=generation, plan_sha256=plan_sha, shards=shards)
        regions[name] = rm
        summaries[name] = RegionSummary(
            manifest=f"{name}/{MANIFEST}", shards=len(shards), samples=rm.samples, bytes=rm.bytes, sha256=manifest_sha(rm)
        )
    sources: list[SourceEntry] = [s for r in results for s in r.sources]
    created = settings.created or datetime.now(UTC).isoformat(timespec="seconds")
    manifest = Manifest(
        generation=generation,
        created=created,
        format=fmt,
        plan=plan.to_dict(),
        plan_sha256=plan_sha,
        layout_sha256=plan.layout_sha256(),
        regions=summaries,
        sources=tuple(sources),
    )
    return manifest, regions


__all__ = ["SplitResult", "SplitSettings", "run_split"]
