"""A region's shard entries as columns: a few buffers, not a Python object per shard.

Opening a manifest of 10^5 shards then costs a few arrays, and DataLoader workers forked after it
share them copy-on-write: iterating reads the buffers without touching a per-shard object's
reference count. ``ShardEntry`` records are built on demand, one at a time.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from geoshard.errors import DataError
from geoshard.manifest import checks, chunkindex
from geoshard.manifest.entry import ShardChunks, ShardEntry
from geoshard.util.paths import SHARD_NAME, check_shard_path, plain_relative

NONE_HEX = "0" * 32  # a version 2 column's placeholder for a digest the shard does not have
# What plain_relative refuses, found in the newline-joined column at once (a newline is a control
# character, so never part of a path): with the column wrapped in newlines, an absolute, empty,
# '.' or '..' part is one of these substrings, and a backslash or control character is _CONTROL.
_BAD_PARTS = ("\n/", "//", "/\n", "\n\n", *(a + d + b for a in "\n/" for b in "\n/" for d in (".", "..")))
_CONTROL = re.compile(r"[\\\x00-\x09\x0b-\x1f\x7f]")


class ShardTable(Sequence[ShardEntry]):
    """The shards of a region manifest, in order; ``table[i]`` builds the i-th ``ShardEntry``."""

    def __init__(self, paths: str, counts: np.ndarray, digests: tuple[np.ndarray, np.ndarray, np.ndarray], blobs: Any, ends: Any) -> None:
        self._paths = paths.encode("utf-8")  # newline-joined
        self._starts = np.concatenate(([0], np.flatnonzero(np.frombuffer(self._paths + b"\n", dtype=np.uint8) == 10) + 1))
        self.counts = counts  # (n, 3) int64: samples, bytes, group
        self._sha256, self._xxh3, self._index = digests  # fixed-width ASCII hex ("" where absent)
        self._blobs, self._ends = blobs, ends  # packed chunk indexes (version 1, or written by the split)
        for a in (self.counts, self._starts):
            a.flags.writeable = False

    @classmethod
    def from_entries(cls, entries: Iterable[ShardEntry]) -> ShardTable:
        rows = Rows()
        for s in entries:
            blob = b"" if s.chunks is None else chunkindex.encode(s.chunks.size, s.chunks.bytes, s.chunks.samples, s.chunks.xxh3_128)
            rows.add(s.path, s.samples, s.bytes, s.group, s.sha256, s.xxh3_128, s.chunk_index, blob)
        return rows.table()

    def __len__(self) -> int:
        return len(self.counts)

    @overload
    def __getitem__(self, i: int) -> ShardEntry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[ShardEntry, ...]: ...
    def __getitem__(self, i: int | slice) -> ShardEntry | tuple[ShardEntry, ...]:
        if isinstance(i, slice):
            return tuple(self._entry(j) for j in range(*i.indices(len(self))))
        i = operator.index(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("shard index out of range")
        return self._entry(i)

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self._entry(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardTable):
            return len(self) == len(other) and all(a == b for a, b in zip(self._key(), other._key(), strict=True))
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards)"

    def path(self, i: int) -> str:
        return self._paths[self._starts[i] : self._starts[i + 1] - 1].decode("utf-8")

    def paths(self) -> list[str]:
        return self._paths.decode("utf-8").split("\n") if len(self) else []

    def check_shard_names(self, where: str) -> None:
        """Every path of geoshard's shard name pattern, in one match over the joined column; the
        first that is not is refused by ``check_shard_path`` (a path could make a tier touch a
        file that is not a shard)."""
        text = self._paths.decode("utf-8")
        if text and not re.fullmatch(f"(?:{SHARD_NAME.pattern})(?:\n(?:{SHARD_NAME.pattern}))*", text):
            for p in text.split("\n"):
                check_shard_path(p, where)

    def chunk_blob(self, i: int) -> bytes:
        """The packed chunk index of shard ``i`` (b"" when it has none here)."""
        return bytes(self._blobs[self._ends[i] : self._ends[i + 1]])

    def _entry(self, i: int) -> ShardEntry:
        samples, size, group = self.counts[i].tolist()
        path, blob = self.path(i), self.chunk_blob(i)
        chunks = None
        if blob:
            csize, recs = chunkindex.records(blob, f"shard {path}", size, samples)
            chunks = ShardChunks(csize, tuple(recs["bytes"].tolist()), tuple(recs["samples"].tolist()), chunkindex.hexes(recs))
        hexes = [c[i].decode("ascii") for c in (self._sha256, self._xxh3, self._index)]
        return ShardEntry(path, samples, size, hexes[0], group, hexes[1], chunks, hexes[2])

    def _key(self) -> tuple[Any, ...]:
        return (self._paths, self.counts.tobytes(), *(c.tolist() for c in (self._sha256, self._xxh3, self._index)), bytes(self._blobs))

    def column(self, name: str) -> np.ndarray:
        """``samples``, ``bytes`` or ``group`` of every shard (read-only)."""
        return self.counts[:, ("samples", "bytes", "group").index(name)]

    def to_columns(self) -> dict[str, Any]:
        """The version 2 form (docs/manifest.md): the chunk indexes become their digests."""
        if len(self) and (self._sha256.dtype.itemsize != 64 or not checks.is_hex(self._sha256.tobytes().decode("ascii", "replace"))):
            raise ValueError("every shard of a version 2 manifest needs its sha256 (64 hex digits)")
        blobs = map(self.chunk_blob, range(len(self)))
        index = [chunkindex.digest(b) if b else x.decode("ascii") for b, x in zip(blobs, self._index, strict=True)]
        return {
            "count": len(self),
            "path": self._paths.decode("utf-8"),
            "samples": self.column("samples").tolist(),
            "bytes": self.column("bytes").tolist(),
            "group": self.column("group").tolist(),
            "sha256": self._sha256.tobytes().decode("ascii"),
            "xxh3_128": "".join(x.decode("ascii") or NONE_HEX for x in self._xxh3.tolist()),
            "chunk_index": "".join(x or NONE_HEX for x in index),
        }

    @classmethod
    def from_columns(cls, d: Any, name: str) -> ShardTable:
        """A version 2 ``shards`` object, every value checked (``checks``) before it is kept."""
        d = checks.mapping(d, "shards", name)
        n = checks.count(d["count"], "shards.count", name)
        paths = d["path"]
        if not isinstance(paths, str) or (paths.count("\n") + 1 if paths else 0) != n:
            raise DataError(f"{name}: shards.path must hold {n:,} newline-separated paths")
        _check_paths(paths, name)
        cols = [_ints(d[k], n, f"shards.{k}", name) for k in ("samples", "bytes", "group")]
        counts = np.stack(cols, axis=1) if n else np.zeros((0, 3), np.int64)
        digests = (_hexes(d["sha256"], n, 64, "shards.sha256", name), _hexes(d["xxh3_128"], n, 32, "shards.xxh3_128", name))
        return cls(paths, counts, (*digests, _hexes(d["chunk_index"], n, 32, "shards.chunk_index", name)), b"", np.zeros(n + 1, np.int64))


class Rows:
    """Builds a table one shard at a time (a version 1 manifest as it streams in, or entries)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.counts: list[tuple[int, int, int]] = []
        self.hexes: tuple[list[str], list[str], list[str]] = ([], [], [])
        self.blobs = bytearray()  # grown in place: no second copy of 10^5 shards' chunk records
        self.ends = [0]

    def add(self, path: str, samples: int, size: int, group: int, sha256: str, xxh3: str, index: str, blob: bytes) -> None:
        self.paths.append(path)
        self.counts.append((samples, size, group))
        for col, h in zip(self.hexes, (sha256, xxh3, index), strict=True):
            col.append(h)
        self.blobs += blob
        self.ends.append(len(self.blobs))

    def table(self) -> ShardTable:
        counts = np.array(self.counts, dtype=np.int64).reshape(len(self.counts), 3)
        digests = tuple(np.array([h.encode("utf-8") for h in col], dtype=bytes) if col else np.zeros(0, "S1") for col in self.hexes)
        return ShardTable("\n".join(self.paths), counts, digests, self.blobs, np.array(self.ends, dtype=np.int64))  # type: ignore[arg-type]


def _check_paths(paths: str, name: str) -> None:
    wrapped = f"\n{paths}\n"
    if any(bad in wrapped for bad in _BAD_PARTS) or _CONTROL.search(paths):
        for p in paths.split("\n"):  # the one rule names the first path it refuses
            plain_relative(p, name)


def _ints(value: Any, n: int, field: str, name: str) -> np.ndarray:
    values = checks.listing(value, field, name)
    if len(values) != n or not set(map(type, values)) <= {int}:
        raise DataError(f"{name}: {field} must list {n:,} integers")
    a = np.array(values, dtype=object)
    if n and (a.min() < 0 or a.max() > checks.MAX_COUNT):
        raise DataError(f"{name}: {field}: every value must be an integer from 0 to {checks.MAX_COUNT:,}")
    return a.astype(np.int64)


def _hexes(value: Any, n: int, width: int, field: str, name: str) -> np.ndarray:
    if not isinstance(value, str) or len(value) != n * width or not checks.is_hex(value):
        raise DataError(f"{name}: {field} must be {n:,} digests of {width} lowercase hex digits, one after another")
    a = np.frombuffer(value.encode("ascii"), dtype=f"S{width}")
    if width == 32:
        a = np.where(a == NONE_HEX.encode(), b"", a).astype(f"S{width}")
    return a
