"""The work one Dask task does: stream a group of sources, route samples, write region shards.

Runs on a worker. Only small metadata goes back to the driver: shard names, counts, hashes, and
the 64-bit key hashes the driver uses to find duplicate keys across groups.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from geoshard.errors import DataError, GeoshardError, StorageError
from geoshard.formats import Format, FormatSpec, format_spec
from geoshard.formats._window import Readable
from geoshard.formats.spec import FieldValue
from geoshard.manifest import SourceEntry
from geoshard.plan.routing import SLOT_BITS, RouteSpec, key_hash
from geoshard.split.sources import HashingReader, S3Access, SourceRef, open_source
from geoshard.split.writer import CHUNK_BYTES as CHUNK_BYTES  # its old import path (tests, benchmarks)
from geoshard.split.writer import ShardOut, ShardWriter

log = logging.getLogger(__name__)
PROGRESS_TOPIC = "geoshard-split-progress"
ProgressFn = Callable[[dict[str, int]], None]  # the driver's progress callback: counts of what was done


@dataclass(frozen=True)
class GroupTask:
    group: int
    sources: tuple[SourceRef, ...]
    fmt: Format
    route: RouteSpec
    region_names: tuple[str, ...]
    target_bytes: int
    target_samples: int
    key_feature: str | None  # TFRecord: the feature holding the sample key
    tmpdir: str
    s3: S3Access
    allow_truncated_tar: bool = False  # a tar without end-of-archive blocks: split what it holds, report it


@dataclass
class GroupResult:
    group: int
    shards: list[ShardOut] = field(default_factory=list)
    sources: list[SourceEntry] = field(default_factory=list)
    samples_in: int = 0
    key_hashes: bytes = b""  # sorted uint64 array
    truncated: list[tuple[str, int]] = field(default_factory=list)  # (source, samples read) of tars without end blocks


class Reporter(Protocol):
    """Where a task in the driver's own process (Dask's threaded scheduler) sends its progress.

    Both methods are called from the task's thread: ``event`` with (samples, bytes) deltas,
    ``check`` at every tick, raising to stop a task whose split was abandoned (a failed task
    elsewhere, Ctrl-C) so that it writes nothing more into the temporary folder."""

    def event(self, counts: dict[str, int]) -> None: ...

    def check(self) -> None: ...


class _Progress:
    """Sends (samples, bytes) deltas to the driver about twice a second: to ``report`` in the
    driver's process, else through Dask events from a ``distributed`` worker."""

    def __init__(self, report: Reporter | None = None) -> None:
        self.report = report
        self.worker: Any = None
        # Only a task on a distributed worker has one, and there distributed is imported already:
        # looking it up in sys.modules keeps the threaded path from paying for its import.
        dist = sys.modules.get("distributed") if report is None else None
        if dist is not None:
            with contextlib.suppress(ValueError):  # not on a worker
                self.worker = dist.get_worker()
        self.last = time.monotonic()
        self.samples = 0
        self.bytes = 0

    def counter(self, hashing: HashingReader) -> Callable[[int], None]:
        """A tick(samples) for one source; bytes come from how far its reader got."""
        read = 0

        def tick(samples: int) -> None:
            nonlocal read
            self.tick(samples, hashing.size - read)
            read = hashing.size

        return tick

    def tick(self, samples: int, nbytes: int, force: bool = False) -> None:
        self.samples += samples
        self.bytes += nbytes
        if self.report is not None:
            self.report.check()
        now = time.monotonic()
        if not (force or now - self.last > 0.5):
            return
        counts = {"samples": self.samples, "bytes": self.bytes}
        if self.report is not None:
            self.report.event(counts)
        elif self.worker is not None:
            self.worker.log_event(PROGRESS_TOPIC, counts)
        else:
            return
        self.samples = self.bytes = 0
        self.last = now


def run_group(task: GroupTask, report: Reporter | None = None) -> GroupResult:
    writers = [ShardWriter(task, r) for r in task.region_names]
    result = GroupResult(group=task.group)
    hashes = array("Q")
    seen: set[int] = set()
    progress = _Progress(report)
    spec = format_spec(task.fmt)
    try:
        for ref in task.sources:
            with open_source(ref, task.s3) as (stream, hashing):
                ends: list[int] = []
                size = None if ref.gzip else ref.size  # known length: declared sizes are checked against it
                sinks = _Sinks(writers, hashes, seen, progress.counter(hashing))
                n = _route(task, spec, ref.url, stream, size, ends.append, sinks)
                hashing.drain()
            if ends:
                result.truncated.append((ref.url, n))
            result.samples_in += n
            result.sources.append(SourceEntry(ref.url, hashing.size, "", task.group, xxh3_128=hashing.hexdigest()))
            if hashing.size != ref.size:
                raise DataError(f"{ref.url}: changed while being split ({ref.size} bytes listed, {hashing.size} read)")
        for w in writers:
            result.shards.extend(w.finish())
    except BaseException:
        for w in writers:
            w.f.close()
        raise
    progress.tick(0, 0, force=True)
    result.key_hashes = array("Q", sorted(hashes)).tobytes()
    return result


@dataclass(frozen=True)
class TaskFailed:
    """What a task returns instead of raising: the error travels as a value, so a worker logs no
    'Compute Failed' traceback for bad input and the driver prints one line."""

    error: GeoshardError


def _as_value(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a task: expected failures come back as :class:`TaskFailed`.

    OS errors (an unreadable file, a full disk) become a StorageError naming the file; a
    MemoryError a DataError (declared sizes are checked before allocating; this is the backstop)."""
    try:
        return fn(*args)
    except GeoshardError as e:
        return TaskFailed(e)
    except OSError as e:
        where = e.filename or "split worker"
        return TaskFailed(StorageError(f"{where}: {e.strerror or e}; the split was not published"))
    except MemoryError:
        return TaskFailed(DataError("out of memory in a split task; a source declares a record or member too large to hold"))


def run_group_task(task: GroupTask, report: Reporter | None = None) -> GroupResult | TaskFailed:
    """:func:`run_group` as the Dask task: errors come back as values."""
    return _as_value(run_group, task, report)  # type: ignore[no-any-return]


def find_key_task(tasks: tuple[GroupTask, ...], h: int) -> tuple[str, list[str]] | TaskFailed:
    return _as_value(find_key, tasks, h)  # type: ignore[no-any-return]


def find_key(tasks: tuple[GroupTask, ...], h: int) -> tuple[str, list[str]]:
    """The key with 64-bit hash ``h`` and the sources holding it (for a duplicate-key error)."""
    key, where = "", []
    for task in tasks:
        spec = format_spec(task.fmt)
        for ref in task.sources:
            with open_source(ref, task.s3) as (stream, _):
                for k in _keys(task, spec, ref.url, stream):
                    if key_hash(k) == h:
                        key = k.decode(errors="replace")
                        where.append(ref.url)
                        break
    return key, where


def _keys(task: GroupTask, spec: FormatSpec, url: str, stream: Readable) -> Iterator[bytes]:
    n = 0
    allow = (lambda offset: None) if task.allow_truncated_tar else None  # the split already reported it
    for keys, raws, bodies in spec.split.batches(stream, url, None, allow):
        yield from _keyed(task, spec, url, keys, bodies, n) or ()
        n += len(raws)


def _keyed(
    task: GroupTask, spec: FormatSpec, url: str, keys: list[bytes] | None, bodies: list[bytes] | None, first: int
) -> list[bytes] | None:
    """A batch's sample keys: their own, else the routing.key feature's, else None (no keys)."""
    if keys is None and task.key_feature is not None:
        assert spec.split.feature_keys is not None and bodies is not None
        return spec.split.feature_keys(bodies, task.key_feature, url, first)
    return keys


def _duplicate(key: bytes, url: str) -> DataError:
    return DataError(f"{url}: duplicate sample key {key.decode(errors='replace')!r}")


@dataclass(frozen=True)
class _Sinks:
    """Where one source's samples go: the regions' writers, the key hashes seen, the progress tick."""

    writers: list[ShardWriter]
    hashes: array[int]
    seen: set[int]
    tick: Callable[[int], None]


def _route(
    task: GroupTask, spec: FormatSpec, url: str, stream: Readable, size: int | None, unterminated: Callable[[int], None], sinks: _Sinks
) -> int:
    """Route every sample of one source to its regions' writers; returns how many there were.

    The hot loop of the split, a batch (a read window) at a time: per sample one hash, one set
    lookup, one list append. The writers write out their views of a batch before the next one
    overwrites the window's reused buffer."""
    route = task.route
    value = spec.split.field_value(route, url) if route.policy == "field" else None
    adds = [w.add for w in sinks.writers]
    releases = [w.release for w in sinks.writers]
    allow = unterminated if task.allow_truncated_tar else None
    n = 0
    for own, raws, bodies in spec.split.batches(stream, url, size, allow):
        keys = _keyed(task, spec, url, own, bodies, n)
        # Samples without keys route by a hash of their bytes and are not checked for duplicates.
        hs = _remember(keys, url, sinks) if keys is not None else [key_hash(b) for b in bodies or raws]
        if route.policy == "hash":
            table, shift = route.table, 64 - SLOT_BITS
            for h, raw in zip(hs, raws, strict=True):
                adds[table[h >> shift]](raw)
        else:
            _send(route, value, adds, raws, bodies, keys, n, url)
        for release in releases:
            release()
        n += len(raws)
        sinks.tick(len(raws))
    return n


def _remember(keys: list[bytes], url: str, sinks: _Sinks) -> list[int]:
    """The keys' hashes, refusing a key seen before in this group."""
    kh, seen, known = key_hash, sinks.seen, sinks.seen.add
    hs = [kh(k) for k in keys]
    for h, key in zip(hs, keys, strict=True):
        if h in seen:
            raise _duplicate(key, url)
        known(h)
    sinks.hashes.extend(hs)
    return hs


def _send(
    route: RouteSpec,
    value: FieldValue | None,
    adds: Sequence[Callable[[bytes | memoryview], None]],
    raws: list[Any],
    bodies: list[bytes] | None,
    keys: list[bytes] | None,
    first: int,
    url: str,
) -> None:
    """Samples routed by a field's value, or to every region."""
    if value is None:
        for raw in raws:
            for r in route.every:
                adds[r](raw)
        return
    for i, raw in enumerate(raws):
        body = bodies[i] if bodies is not None else None
        v, label = value(raw, body, keys[i] if keys is not None else None, first + i)
        for r in route.by_value(v, url, label, body if body is not None else raw):
            adds[r](raw)
