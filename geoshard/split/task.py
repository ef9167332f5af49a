"""The work one Dask task does: stream a group of sources, route samples, write region shards.

Runs on a worker. Only small metadata goes back to the driver: shard names, counts, hashes, and
the 64-bit key hashes the driver uses to find duplicate keys across groups.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from geoshard.errors import DataError, GeoshardError, StorageError
from geoshard.formats import SHARD_SUFFIX, Format, tfrecord, wds
from geoshard.formats._window import Readable
from geoshard.manifest import ShardChunks, SourceEntry
from geoshard.plan.routing import SLOT_BITS, RouteSpec, feature_key, key_hash
from geoshard.split.sources import HashingReader, S3Access, SourceRef, open_source
from geoshard.util.hashing import FAST, ChunkHasher, MultiHasher

log = logging.getLogger(__name__)
PROGRESS_TOPIC = "geoshard-split-progress"
ProgressFn = Callable[[dict[str, int]], None]  # the driver's progress callback: counts of what was done
_FLUSH = 1 << 20
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
# A shard's chunks (each with its xxh3-128 in the manifest) end at the first sample boundary past
# this size. 512 KiB: a reader's first batch (128 samples of a few KB is ~0.5 MB) needs one or two
# chunks, not a whole shard; with 1 MiB the first round of two workers was twice the bytes and the
# first batch missed its goal behind a capped link (docs/benchmarks.md). The cost: ~70 manifest
# bytes per MiB of shards (70 MB of manifest for 1 TB in one region).
CHUNK_BYTES = 512 << 10


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


@dataclass(frozen=True)
class ShardOut:
    region: str
    name: str  # file name inside tmpdir/<region>/ and, once published, DIR/<region>/
    samples: int
    bytes: int
    sha256: str
    group: int
    xxh3_128: str = ""
    chunks: ShardChunks | None = None


@dataclass
class GroupResult:
    group: int
    shards: list[ShardOut] = field(default_factory=list)
    sources: list[SourceEntry] = field(default_factory=list)
    samples_in: int = 0
    key_hashes: bytes = b""  # sorted uint64 array
    truncated: list[tuple[str, int]] = field(default_factory=list)  # (source, samples read) of tars without end blocks


class _ShardWriter:
    """Writes one region's shards for one group, rolling over at the target size.

    Bytes are buffered and hashed per flush, so the sha256 costs no second read of the shard.
    """

    def __init__(self, task: GroupTask, region: str) -> None:
        self.task = task
        self.region = region
        self.dir = Path(task.tmpdir) / region
        self.dir.mkdir(parents=True, exist_ok=True)
        self.part = 0
        self.done: list[ShardOut] = []
        self.trailer = 2 * wds.BLOCK if task.fmt == "wds" else 0
        self._open()

    def _open(self) -> None:
        self.path = self.dir / f"{self.task.group:05d}-{self.part:04d}.partial"
        self.f = open(self.path, "wb", buffering=0)  # noqa: SIM115 - closed in _close
        self.parts: list[bytes | memoryview] = []
        self.pending = 0
        self.hasher = MultiHasher(("sha256", FAST))  # both digests of record, fed once per flush
        self.chunks = ChunkHasher()
        self.chunk_bytes = 0  # of the chunk being filled, counted as samples are added
        self.chunk_samples: list[int] = [0]  # samples per chunk
        self.cuts: list[int] = []  # positions in self.parts where a new chunk begins
        self.bytes = 0
        self.samples = 0

    def _flush(self) -> None:
        # Hash each part and hand the list to writev: the samples are copied once, into the kernel.
        update, chunk = self.hasher.update, self.chunks.update
        cuts = iter(self.cuts)
        cut = next(cuts, -1)
        for i, part in enumerate(self.parts):
            if i == cut:
                self.chunks.cut()
                cut = next(cuts, -1)
            update(part)
            chunk(part)
        self.cuts = []
        fd = self.f.fileno()
        parts = self.parts
        while parts:
            batch = parts[:_IOV_MAX]
            n = os.writev(fd, batch)
            total = sum(len(p) for p in batch)
            if n < total:  # a short write: finish the rest the simple way
                self._write_all(b"".join(batch)[n:])
            parts = parts[_IOV_MAX:]
        self.parts = []
        self.pending = 0

    def release(self) -> None:
        """Write what is pending now: its views into the read window must not outlive it."""
        if self.parts:
            self._flush()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.f.fileno(), view) :]

    def add(self, raw: bytes | memoryview) -> None:
        """Append one sample (a framed record, or a sample's compact tar members)."""
        size = len(raw)
        t = self.task
        if self.samples and (self.bytes + size + self.trailer > t.target_bytes or (t.target_samples and self.samples >= t.target_samples)):
            self._roll()
        if self.chunk_bytes >= CHUNK_BYTES:  # the chunk is full: this sample begins the next one
            self.cuts.append(len(self.parts))
            self.chunk_samples.append(0)
            self.chunk_bytes = 0
        self.parts.append(raw)  # a memoryview into the read window: copied once, at flush
        self.chunk_bytes += size
        self.chunk_samples[-1] += 1
        self.bytes += size
        self.samples += 1
        self.pending += size
        if self.pending >= _FLUSH:
            self._flush()

    def _close(self) -> None:
        if self.trailer:
            self.parts.append(bytes(self.trailer))
        self._flush()
        self.f.close()
        if self.samples == 0:
            self.path.unlink()
            return
        size = self.path.stat().st_size
        digests = self.hasher.hexdigests()
        self.chunks.cut()  # the last chunk holds the end blocks too
        chunks = ShardChunks(CHUNK_BYTES, tuple(self.chunks.sizes), tuple(self.chunk_samples), tuple(self.chunks.digests))
        sha = digests["sha256"]
        # The content hash in the name makes shards immutable objects: a changed shard gets a new
        # name, so caches and buckets never serve stale bytes under an old name.
        name = f"{self.task.group:05d}-{self.part:04d}-{sha[:12]}{SHARD_SUFFIX[self.task.fmt]}"
        os.replace(self.path, self.dir / name)
        self.done.append(ShardOut(self.region, name, self.samples, size, sha, self.task.group, digests[FAST], chunks))

    def _roll(self) -> None:
        self._close()
        self.part += 1
        self._open()

    def finish(self) -> list[ShardOut]:
        self._close()
        return self.done


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
        # looking it up in sys.modules keeps the threaded path from importing it (~0.3 s).
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
    writers = [_ShardWriter(task, r) for r in task.region_names]
    result = GroupResult(group=task.group)
    hashes = array("Q")
    seen: set[int] = set()
    progress = _Progress(report)
    try:
        for ref in task.sources:
            with open_source(ref, task.s3) as (stream, hashing):
                route = _route_wds if task.fmt == "wds" else _route_tfrecord
                ends: list[int] = []
                size = None if ref.gzip else ref.size  # known length: declared sizes are checked against it
                n = route(task, ref.url, stream, size, ends.append, writers, hashes, seen, progress.counter(hashing))
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
        for ref in task.sources:
            with open_source(ref, task.s3) as (stream, _):
                if task.fmt == "wds":
                    keys: Iterator[bytes] = (
                        k for k, _ in wds.iter_raw_samples(stream, ref.url, _skip if task.allow_truncated_tar else None)
                    )
                else:
                    assert task.key_feature is not None
                    keys = (feature_key(r, task.key_feature, ref.url, i) for i, r in enumerate(tfrecord.iter_records(stream, ref.url)))
                for k in keys:
                    if key_hash(k) == h:
                        key = k.decode(errors="replace")
                        where.append(ref.url)
                        break
    return key, where


def _skip(offset: int) -> None:
    pass


def _duplicate(key: bytes, url: str) -> DataError:
    return DataError(f"{url}: duplicate sample key {key.decode(errors='replace')!r}")


def _route_wds(
    task: GroupTask,
    url: str,
    stream: Readable,
    size: int | None,
    unterminated: Callable[[int], None],
    writers: list[_ShardWriter],
    hashes: array[int],
    seen: set[int],
    tick: Callable[[int], None],
) -> int:
    route = task.route
    policy = route.policy
    value = route.wds_value() if policy == "field" else None
    table, every = route.table, route.every
    adds = [w.add for w in writers]
    blake, from_bytes, shift = hashlib.blake2b, int.from_bytes, 64 - SLOT_BITS
    remember, known = hashes.append, seen.add
    n = 0
    # The hot loop of the split: per sample one hash, one set lookup, one list append.
    allow = unterminated if task.allow_truncated_tar else None
    # The window's buffer is reused: each writer writes out its views of it before the next fill.
    releases = [w.release for w in writers]
    for buf, keys, starts, ends in wds.iter_raw_windows(stream, url, allow, size, reuse=True):
        mv = memoryview(buf)
        for key, start, end in zip(keys, starts, ends, strict=True):
            h = from_bytes(blake(key, digest_size=8).digest(), "little")
            if h in seen:
                raise _duplicate(key, url)
            known(h)
            remember(h)
            raw = mv[start:end]
            if policy == "hash":
                adds[table[h >> shift]](raw)
            else:
                if value is None:
                    targets = every
                else:
                    sample = bytes(raw)
                    targets = route.by_value(value(sample), url, repr(key.decode(errors="replace")), sample)
                for r in targets:
                    adds[r](raw)
        for release in releases:
            release()
        n += len(keys)
        tick(len(keys))
    return n


def _route_tfrecord(
    task: GroupTask,
    url: str,
    stream: Readable,
    size: int | None,
    unterminated: Callable[[int], None],
    writers: list[_ShardWriter],
    hashes: array[int],
    seen: set[int],
    tick: Callable[[int], None],
) -> int:
    route = task.route
    policy = route.policy
    tvalue = route.tfrecord_value(url) if policy == "field" else None
    keyname = task.key_feature
    n = 0
    for index, (record, framed) in enumerate(tfrecord.iter_framed(stream, url, size)):
        if keyname is not None:
            key = feature_key(record, keyname, url, index)
            wds.check_key(key, f"{url}: record {index}")
            h = key_hash(key)
            if h in seen:
                raise _duplicate(key, url)
            seen.add(h)
            hashes.append(h)
        else:
            h = key_hash(record)
        if policy == "hash":
            targets = route.by_hash(h)
        elif tvalue is not None:
            targets = route.by_value(tvalue(record, index), url, f"record {index}", record)
        else:
            targets = route.every
        for r in targets:
            writers[r].add(framed)
        n += 1
        if n & 1023 == 0:
            tick(1024)
    tick(n & 1023)
    return n
