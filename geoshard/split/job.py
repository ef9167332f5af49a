"""The split as a Dask job: list sources, group them, run one task per group, publish.

The driver only lists, schedules and publishes; the tasks read sources and write shards, so no
sample passes through the driver. The tasks run on Dask's threaded scheduler in this process
(geoshard/split/threaded.py) or on a ``distributed`` cluster (geoshard/split/cluster.py). The
output folder is locked for the duration of a split.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from geoshard.errors import ConfigError, DataError, LockedError, StorageError
from geoshard.formats import Format, format_spec
from geoshard.manifest import (
    MANIFEST,
    VERSION,
    Manifest,
    RegionManifest,
    RegionSummary,
    ShardEntry,
    SourceEntry,
    default_version,
    read_manifest,
    read_region_manifest,
)
from geoshard.plan import Plan
from geoshard.plan.routing import RouteSpec
from geoshard.split.groups import make_groups
from geoshard.split.publish import KEYS, TMP, manifest_sha, publish
from geoshard.split.sources import S3Access, SourceRef, expand_sources, hash_source, refuse_out_inside
from geoshard.split.task import GroupResult, GroupTask, ProgressFn, TaskFailed, find_key_task
from geoshard.util.hashing import FAST


@dataclass(frozen=True)
class SplitSettings:
    out: Path
    workers: int | None = None  # threads, or in-process LocalCluster worker processes; None: one per core
    processes: bool | None = None  # in-process LocalCluster of worker processes; None: threads for local sources
    scheduler: str | None = None  # tcp://host:port of an existing cluster
    fmt: Format | None = None  # None: from file names / content
    s3: S3Access = field(default_factory=S3Access)
    replace: bool = False  # allow replacing a split of a different plan
    created: str | None = None  # fixed creation time (SOURCE_DATE_EPOCH) for reproducible manifests
    incremental: bool = False  # re-split only groups whose sources changed, add new sources as new groups
    allow_truncated_tar: bool = False  # split tars that end without end-of-archive blocks; SplitResult.truncated names them
    # Region manifests' version (docs/manifest.md): 2 keeps one entry per shard and each shard's chunk
    # index beside it; None: 2 once a region holds V2_FROM_SHARDS shards, else that of the split
    # already in ``out`` (an incremental split keeps it), else 1 (``manifest.default_version``).
    manifest_version: int | None = None


@dataclass(frozen=True)
class SplitResult:
    manifest: Manifest
    regions: dict[str, RegionManifest]
    samples_in: int  # samples read by this run's tasks (all of them unless incremental)
    bytes_in: int
    seconds: float  # the whole split, from listing sources to publishing
    cluster_seconds: float = 0.0  # starting or connecting to the Dask cluster (~0 on threads)
    job_seconds: float = 0.0  # the tasks: from submission to the last result
    cluster: str = ""  # where the tasks ran: "threads" (Dask's threaded scheduler), "processes" (in-process cluster), "scheduler"
    groups_run: tuple[int, ...] = ()  # groups (re-)split by this run
    unchanged: bool = False  # incremental run that found nothing to do; nothing was published
    truncated: tuple[tuple[str, int], ...] = ()  # (source, samples read) of tars without end blocks, when allowed


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / ".geoshard.lock", "w")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror}); choose a writable folder") from e
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockedError(f"{out}: another geoshard split or refresh is writing this folder; try again when it ends") from None
        yield


def cluster_kind(settings: SplitSettings, remote_sources: bool) -> str:
    """ "scheduler" (``--scheduler``), "processes" (an in-process ``LocalCluster`` of worker
    processes: ``--processes``, or by default when a source is on S3), else "threads" (Dask's
    threaded scheduler in this process)."""
    if settings.scheduler:
        return "scheduler"
    return "processes" if (settings.processes if settings.processes is not None else remote_sources) else "threads"


def run_split(sources: Sequence[str], plan: Plan, settings: SplitSettings, progress: ProgressFn | None = None) -> SplitResult:
    try:
        return _run_split(sources, plan, settings, progress)
    except OSError as e:  # the driver's own writes (a full disk, a folder made read-only meanwhile)
        raise StorageError(f"{e.filename or settings.out}: {e.strerror or e}; the split was not published") from e


def _run_split(sources: Sequence[str], plan: Plan, settings: SplitSettings, progress: ProgressFn | None) -> SplitResult:
    t0 = time.monotonic()
    out = settings.out
    refuse_out_inside(sources, out)
    _check_out(out, plan, settings.replace)  # fail before listing sources; checked again under the lock
    refs = expand_sources(sources, settings.fmt, settings.s3)
    fmt: Format = refs[0].format
    route = RouteSpec(plan, fmt)  # refuses routing a format cannot honour (routing.key on WebDataset)
    keyed_by_feature = format_spec(fmt).split.keyed_by_feature
    with _locked(out):
        previous = _check_out(out, plan, settings.replace)
        if settings.incremental and previous is not None and previous.format == fmt:
            work, kept = plan_increment(refs, previous, plan, settings.s3)
        else:
            work, kept = list(enumerate(make_groups(refs, plan))), {}
        if not work and previous is not None and set(kept) == {s.group for s in previous.sources}:
            return SplitResult(previous, {}, 0, 0, time.monotonic() - t0, unchanged=True)
        shutil.rmtree(out / TMP, ignore_errors=True)  # leftovers of an interrupted split
        tmpdir = out / TMP / f"run-{os.getpid()}-{int(time.time())}"
        tmpdir.mkdir(parents=True)
        try:
            tasks = [
                GroupTask(
                    group=gid,
                    sources=g,
                    fmt=fmt,
                    route=route,
                    region_names=plan.region_names,
                    target_bytes=plan.shards.bytes,
                    target_samples=plan.shards.samples,
                    key_feature=plan.routing.key if keyed_by_feature else None,
                    tmpdir=str(tmpdir.resolve()),
                    s3=settings.s3,
                    allow_truncated_tar=settings.allow_truncated_tar,
                )
                for gid, g in work
            ]
            if progress is not None:  # the bar's total, before the cluster starts
                progress({"total_bytes": sum(ref.size for t in tasks for ref in t.sources)})
            kind = cluster_kind(settings, any(ref.url.startswith("s3://") for _, g in work for ref in g))
            results, timing = _run_tasks(tasks, settings, kind, progress, _kept_keys(out, kept))
            version = (settings.manifest_version, _previous_version(out, previous))
            manifest, regions = _manifests(plan, fmt, results, previous, version, _kept_entries(out, previous, kept), settings.created)
            publish(out, tmpdir, manifest, regions, {r.group: r.key_hashes for r in results})
        except BaseException:
            shutil.rmtree(out / TMP, ignore_errors=True)
            raise
    return SplitResult(
        manifest=manifest,
        regions=regions,
        samples_in=sum(r.samples_in for r in results),
        bytes_in=sum(r.size for _, g in work for r in g),
        seconds=time.monotonic() - t0,
        cluster_seconds=timing[0],
        job_seconds=timing[1],
        cluster=kind,
        groups_run=tuple(gid for gid, _ in work),
        truncated=tuple(t for r in results for t in r.truncated),
    )


KeptGroup = tuple[int, tuple[SourceRef, ...], bytes]  # (group, its sources, its sorted key hashes)


def _kept_keys(out: Path, kept: dict[int, tuple[SourceRef, ...]]) -> list[KeptGroup]:
    """Key hashes of groups this run keeps, for the duplicate check across all groups."""
    found = []
    for gid, refs in kept.items():
        path = out / KEYS / f"{gid:05d}.u64"
        found.append((gid, refs, path.read_bytes() if path.exists() else b""))
    return found


def _kept_entries(
    out: Path, previous: Manifest | None, kept: dict[int, tuple[SourceRef, ...]]
) -> tuple[dict[str, list[ShardEntry]], list[SourceEntry]]:
    if previous is None or not kept:
        return {}, []
    shards = {}
    for name, r in previous.regions.items():
        shards[name] = [sh for sh in read_region_manifest(out / r.manifest).shards if sh.group in kept]
    return shards, [src for src in previous.sources if src.group in kept]


def _previous_version(out: Path, previous: Manifest | None) -> int:
    for r in previous.regions.values() if previous else ():
        try:
            return read_region_manifest(out / r.manifest).version
        except DataError:
            break
    return VERSION


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
    tasks: list[GroupTask], settings: SplitSettings, kind: str, progress: ProgressFn | None, kept: list[KeptGroup]
) -> tuple[list[GroupResult], tuple[float, float]]:
    results: list[GroupResult] = []
    progress = _serialized(progress) if progress is not None else None
    start = _runner(settings, kind)  # imports dask or distributed: not part of the cluster's start
    t0 = time.monotonic()
    with start(progress) as runner:
        t1 = time.monotonic()

        def done(res: GroupResult) -> None:
            results.append(res)
            if progress is not None:
                progress({"shards": len(res.shards)})

        runner.run(tasks, done)
        t2 = time.monotonic()
        _check_duplicates(runner, results, tasks, kept)
    return sorted(results, key=lambda r: r.group), (t1 - t0, t2 - t1)


def _runner(settings: SplitSettings, kind: str) -> Callable[[ProgressFn | None], AbstractContextManager[Runner]]:
    """Dask's threaded scheduler in this process, else a ``distributed`` cluster (imported only then)."""
    if kind == "threads":
        from geoshard.split.threaded import threaded_runner

        return functools.partial(threaded_runner, settings.workers)
    from geoshard.split.cluster import cluster_runner

    return functools.partial(cluster_runner, settings.scheduler, settings.workers)


class Runner(Protocol):
    """Where the tasks run: geoshard/split/threaded.py or geoshard/split/cluster.py."""

    def run(self, tasks: Sequence[GroupTask], on_result: Callable[[GroupResult], None]) -> None: ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


def _serialized(progress: ProgressFn) -> ProgressFn:
    """``progress`` for callers in several threads (tasks, the driver, a client's event loop)."""
    lock = threading.Lock()

    def locked(event: dict[str, int]) -> None:
        with lock:
            progress(event)

    return locked


def _check_duplicates(runner: Runner, results: list[GroupResult], tasks: list[GroupTask], kept: list[KeptGroup]) -> None:
    """Each task rejects duplicates inside its group; this finds keys repeated across groups."""
    import numpy as np

    sources = {t.group: t.sources for t in tasks} | {gid: refs for gid, refs, _ in kept}
    keyed = [(r.group, r.key_hashes) for r in results if r.key_hashes] + [(gid, h) for gid, _, h in kept if h]
    if len(keyed) < 2:
        return
    arrays = [np.frombuffer(h, dtype=np.uint64) for _, h in keyed]
    owners = np.concatenate([np.full(len(a), gid, dtype=np.int64) for a, (gid, _) in zip(arrays, keyed, strict=True)])
    allh = np.concatenate(arrays)
    order = np.argsort(allh, kind="stable")
    sorted_h = allh[order]
    dup = np.flatnonzero(sorted_h[1:] == sorted_h[:-1])
    if len(dup) == 0:
        return
    i = int(dup[0])
    t = tasks[0]
    groups = tuple(
        GroupTask(g, sources[g], t.fmt, t.route, t.region_names, 0, 0, t.key_feature, t.tmpdir, t.s3)
        for g in (int(owners[order[i]]), int(owners[order[i + 1]]))
    )
    # Only the 64-bit hash came back; a task finds the key and its sources for the message.
    found = runner.call(find_key_task, groups, int(sorted_h[i]))
    if isinstance(found, TaskFailed):
        raise found.error
    raise DataError(f"duplicate sample key {found[0]!r} in {' and '.join(found[1])}")


def plan_increment(
    refs: Sequence[SourceRef], previous: Manifest, plan: Plan, s3: S3Access
) -> tuple[list[tuple[int, tuple[SourceRef, ...]]], dict[int, tuple[SourceRef, ...]]]:
    """Groups to re-split (a source changed or vanished) or to add (new sources), and groups to keep.

    A source is unchanged when its path, size and digest match the manifest (its xxh3_128, or its
    sha256 in a manifest written before sources were recorded by xxh3_128); only sources whose
    size still matches are re-hashed.
    """
    current = {r.url: r for r in refs}
    changed = {s.group for s in previous.sources if s.url not in current or current[s.url].size != s.size}
    same_size = [(s, current[s.url]) for s in previous.sources if s.url in current and current[s.url].size == s.size]
    with ThreadPoolExecutor(max_workers=4) as pool:  # both hashes release the GIL
        digests = list(pool.map(lambda pair: hash_source(pair[1], s3, FAST if pair[0].xxh3_128 else "sha256"), same_size))
    changed |= {s.group for (s, _), digest in zip(same_size, digests, strict=True) if digest != (s.xxh3_128 or s.sha256)}
    groups: dict[int, list[SourceRef]] = {}
    for s in previous.sources:
        if s.url in current:
            groups.setdefault(s.group, []).append(current[s.url])
    known = {s.url for s in previous.sources}
    fresh = [r for r in refs if r.url not in known]
    next_id = max((s.group for s in previous.sources), default=-1) + 1
    work = [(g, tuple(groups[g])) for g in sorted(changed) if g in groups]
    work += [(next_id + i, g) for i, g in enumerate(make_groups(fresh, plan))] if fresh else []
    return work, {g: tuple(refs_) for g, refs_ in groups.items() if g not in changed}


def _manifests(
    plan: Plan,
    fmt: Format,
    results: list[GroupResult],
    previous: Manifest | None,
    version: tuple[int | None, int],
    kept: tuple[dict[str, list[ShardEntry]], list[SourceEntry]] = ({}, []),
    created: str | None = None,
) -> tuple[Manifest, dict[str, RegionManifest]]:
    """``version``: the one asked for (None: ``default_version``) and that of the split replaced."""
    generation = (previous.generation + 1) if previous else 1
    plan_sha = plan.sha256()
    regions: dict[str, RegionManifest] = {}
    summaries: dict[str, RegionSummary] = {}
    per_region = {}
    for name in plan.region_names:
        mine = [s for r in results for s in r.shards if s.region == name]
        fresh = [ShardEntry(s.name, s.samples, s.bytes, s.sha256, s.group, s.xxh3_128, s.chunks) for s in mine]
        per_region[name] = tuple(sorted(fresh + kept[0].get(name, []), key=lambda e: e.path))
    asked, before = version
    written = asked or default_version(max(map(len, per_region.values()), default=0), before)
    for name, shards in per_region.items():
        rm = RegionManifest(name, fmt, generation, plan_sha, shards, written)
        regions[name] = rm
        summaries[name] = RegionSummary(
            manifest=f"{name}/{MANIFEST}", shards=len(shards), samples=rm.samples, bytes=rm.bytes, sha256=manifest_sha(rm)
        )
    sources = sorted([s for r in results for s in r.sources] + kept[1], key=lambda s: (s.group, s.url))
    created = created or datetime.now(UTC).isoformat(timespec="seconds")
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
