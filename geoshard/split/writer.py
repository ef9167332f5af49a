"""Writing one region's shards for one split task: buffered, hashed as written, rolled over at
the plan's target size, named by their content."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from geoshard.formats import format_spec
from geoshard.manifest import ShardChunks
from geoshard.util.hashing import FAST, ChunkHasher, MultiHasher

if TYPE_CHECKING:
    from geoshard.split.task import GroupTask

_FLUSH = 1 << 20
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
# A shard's chunks (each with its xxh3-128 in the manifest) end at the first sample boundary past
# this size: small enough that a reader's first batch needs one or two chunks, not a whole shard
# (larger chunks made the first round of workers fetch more than the first batch needs, behind a
# capped link: docs/benchmarks.md), large enough that the manifest stays a small fraction of them.
CHUNK_BYTES = 512 << 10


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


class ShardWriter:
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
        self.spec = format_spec(task.fmt)
        self.trailer = len(self.spec.trailer)  # bytes that will end the shard: counted against its target size
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
            self.parts.append(self.spec.trailer)
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
        name = f"{self.task.group:05d}-{self.part:04d}-{sha[:12]}{self.spec.suffix}"
        os.replace(self.path, self.dir / name)
        self.done.append(ShardOut(self.region, name, self.samples, size, sha, self.task.group, digests[FAST], chunks))

    def _roll(self) -> None:
        self._close()
        self.part += 1
        self._open()

    def finish(self) -> list[ShardOut]:
        self._close()
        return self.done
