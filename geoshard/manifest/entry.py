"""A shard's entry in its region manifest, and its chunks (docs/manifest.md)."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any

import numpy as np

from geoshard.errors import DataError
from geoshard.formats import FORMATS
from geoshard.manifest import checks, chunkindex
from geoshard.util.paths import plain_relative


@dataclass(frozen=True)
class ShardChunks:
    """A shard cut into chunks of whole samples, each with its own fast hash (docs/manifest.md).

    A chunk ends at the first sample boundary at or past ``size`` bytes (the last one also holds
    the tar's end blocks), so any chunk can be read, checked and parsed alone."""

    size: int
    bytes: tuple[int, ...]  # per chunk
    samples: tuple[int, ...]  # per chunk
    xxh3_128: tuple[str, ...]  # per chunk, 32 hex digits

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "bytes": list(self.bytes), "samples": list(self.samples), "xxh3_128": list(self.xxh3_128)}

    def index(self) -> builtins.bytes:
        """The binary chunk index of these chunks (``chunkindex``)."""
        return chunkindex.encode(self.size, self.bytes, self.samples, self.xxh3_128)

    @classmethod
    def from_index(cls, data: builtins.bytes, where: str, shard_bytes: int, shard_samples: int) -> ShardChunks:
        size, recs = chunkindex.records(data, where, shard_bytes, shard_samples)
        return cls(size, tuple(recs["bytes"].tolist()), tuple(recs["samples"].tolist()), chunkindex.hexes(recs))


def chunks_index(d: Any, where: str, shard_bytes: int, shard_samples: int) -> bytes:
    """A version 1 ``chunks`` object, checked, as its binary chunk index (no object per chunk kept)."""
    try:
        d = checks.mapping(d, "chunks", where)
        size = checks.count(d["size"], "chunks.size", where)
        sizes, samples, hexes = (checks.listing(d[k], f"chunks.{k}", where) for k in ("bytes", "samples", "xxh3_128"))
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where}: chunks: missing or invalid {e}") from e
    n = len(sizes)
    if not n or len(samples) != n or len(hexes) != n:
        raise DataError(f"{where}: chunks: bytes, samples and xxh3_128 must list the same number of chunks (at least one)")
    cols = [_counts(values, field, where) for field, values in (("chunks.bytes", sizes), ("chunks.samples", samples))]
    if not set(map(type, hexes)) <= {str} or set(map(len, hexes)) != {32} or not checks.is_hex(joined := "".join(hexes)):
        raise DataError(f"{where}: chunks: every xxh3_128 must be 32 lowercase hex digits")
    if cols[0].min() <= 0 or sum(sizes) != shard_bytes or sum(samples) != shard_samples:
        raise DataError(f"{where}: chunks: their bytes and samples must add up to the shard's ({shard_bytes}, {shard_samples})")
    return chunkindex.encode(size, cols[0], cols[1], [joined])


def _counts(values: list[Any], field: str, where: str) -> np.ndarray:
    """A list of counts as an array; the first that is not one is refused by ``checks.count``."""
    if set(map(type, values)) <= {int}:
        try:
            a = np.array(values, dtype=np.int64)
            if a.min() >= 0 and a.max() <= checks.MAX_COUNT:
                return a
        except OverflowError:
            pass
    for v in values:
        checks.count(v, field, where)
    raise AssertionError("unreachable: some value was not a count")


@dataclass(frozen=True)
class ShardEntry:
    path: str
    samples: int
    bytes: int
    sha256: str
    group: int = 0
    xxh3_128: str = ""  # the fast hash of record (geoshard/util/hashing.py); "" in manifests written before it
    chunks: ShardChunks | None = None  # per-chunk hashes; None in manifests written before them, or in a version 2 one
    chunk_index: str = ""  # version 2: xxh3-128 of <path>.chunks (``chunkindex``); "" where the shard has none

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256, "group": self.group}
        if self.xxh3_128:
            d["xxh3_128"] = self.xxh3_128
        if self.chunks is not None:
            d["chunks"] = self.chunks.to_dict()
        return d


def v1_row(s: Any, name: str, index: int, fmt: Any) -> tuple[str, int, int, int, str, str, str, builtins.bytes]:
    """One version 1 shard object, checked, as the row ``table.Rows.add`` takes. Its samples are
    checked against its bytes here when the ``fmt`` read before the list is known, else later."""
    field = f"shards[{index}]"
    s = checks.mapping(s, field, name)
    path = plain_relative(str(s["path"]), name)
    samples, size = checks.count(s["samples"], f"{field}.samples", name), checks.count(s["bytes"], f"{field}.bytes", name)
    if fmt in FORMATS:
        checks.samples_fit(samples, size, fmt, f"{field} ({path})", name)
    group = checks.count(s.get("group", 0), f"{field}.group", name)
    chunks = s.get("chunks")
    blob = b"" if chunks is None else chunks_index(chunks, f"{name}: shard {path}", size, samples)
    return path, samples, size, group, str(s["sha256"]), str(s.get("xxh3_128", "")), "", blob
