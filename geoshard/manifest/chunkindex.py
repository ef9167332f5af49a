"""A shard's chunk index: its chunks' bytes, samples and xxh3-128 as one small binary file.

Version 2 region manifests keep one entry per shard; the chunk hashes a reader needs only when it
fetches a shard live in ``<shard>.chunks`` beside it (docs/manifest.md), checked against the
``chunk_index`` digest of the shard's entry before use. Version 1 manifests hold the same records
inline; the reader packs them into these bytes too, so one decoder serves both.

Layout (little-endian): the 8-byte magic, the chunk ``size`` and the chunk count (u64 each), then
one 32-byte record per chunk: bytes (u64), samples (u64), xxh3-128 (16 bytes, big-endian as its
hex digits read).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from geoshard.errors import DataError
from geoshard.manifest import checks
from geoshard.util.hashing import xxh3_128

SUFFIX = ".chunks"
MAGIC = b"GSCHUNK1"
_HEAD = struct.Struct("<8sQQ")
RECORD = np.dtype([("bytes", "<u8"), ("samples", "<u8"), ("xxh3_128", "u1", (16,))])
MAX_CHUNKS = 1 << 24  # bounds what a claimed count may allocate: a 1 TB shard of 64 KiB chunks


def index_name(shard_path: str) -> str:
    """The chunk index's name beside its shard."""
    return shard_path + SUFFIX


def encode(size: int, sizes: Any, samples: Any, digests_hex: Any) -> bytes:
    """The index bytes of a shard's chunks (``digests_hex``: 32 hex digits each)."""
    n = len(sizes)
    records = np.zeros(n, dtype=RECORD)
    records["bytes"] = sizes
    records["samples"] = samples
    records["xxh3_128"] = np.frombuffer(bytes.fromhex("".join(digests_hex)), dtype=np.uint8).reshape(n, 16)
    return _HEAD.pack(MAGIC, size, n) + records.tobytes()


def digest(data: bytes) -> str:
    """What a shard entry records of its index: the xxh3-128 of its bytes."""
    return xxh3_128(data)


def records(data: bytes, where: str, shard_bytes: int, shard_samples: int) -> tuple[int, np.ndarray]:
    """(chunk size, records) of an index, refused in one line unless it describes the shard whole."""
    if len(data) < _HEAD.size:
        raise DataError(f"{where}: chunk index of {len(data)} bytes is too short")
    magic, size, n = _HEAD.unpack_from(data)
    if magic != MAGIC or not 0 < n <= MAX_CHUNKS or len(data) != _HEAD.size + n * RECORD.itemsize:
        raise DataError(f"{where}: not a geoshard chunk index (magic, count or length wrong)")
    recs = np.frombuffer(data, dtype=RECORD, count=n, offset=_HEAD.size)
    sizes, counts = recs["bytes"], recs["samples"]
    if size > checks.MAX_COUNT or sizes.max() > checks.MAX_COUNT or counts.max() > checks.MAX_COUNT or sizes.min() == 0:
        raise DataError(f"{where}: chunks: a chunk is empty or a count is out of range")
    if sum(sizes.tolist()) != shard_bytes or sum(counts.tolist()) != shard_samples:  # exact: no integer wraps
        raise DataError(f"{where}: chunks: their bytes and samples must add up to the shard's ({shard_bytes}, {shard_samples})")
    return int(size), recs


def hexes(recs: np.ndarray) -> tuple[str, ...]:
    """The records' xxh3-128 as 32 hex digits each."""
    flat = recs["xxh3_128"].tobytes().hex()
    return tuple(flat[i : i + 32] for i in range(0, len(flat), 32))
