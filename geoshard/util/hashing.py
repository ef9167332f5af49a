"""The hash functions of record, in one place.

Every shard carries two digests in its manifest:

- ``sha256``: cryptographic, the name's content hash, what a user checks a shard against;
- ``xxh3_128``: xxHash's XXH3 with 128 bits, not cryptographic but ~15-20x faster than sha256
  here (~20-30 GB/s per core against ~1.5-1.8 GB/s; ``bench/loader_bench.py`` measures both).
  Reads verify with it by default: it catches accidental damage (truncation, bit flips, crossed
  responses) at memory speed; ``verify="sha256"`` stays for a check against tampering. (blake3
  would be cryptographic, but ~3-5x slower than XXH3 per core, and its parallel speed needs the
  cores the loader's workers use.)

A shard's chunks (runs of whole samples of about ``CHUNK_BYTES``) also get an xxh3-128 each
(``ChunkHasher``), so a reader can fetch and check a part of a shard before the rest arrives.

Both ``update`` calls release the GIL on large buffers, so threads hash in parallel with the
consumer. Manifests written before the fast hash existed have no ``xxh3_128``; readers then fall
back to sha256 (``verify_digest``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xxhash

FAST = "xxh3_128"
ALGORITHMS = ("sha256", FAST, "md5")
_PIECE = 1 << 20  # cache-sized pieces: hashing a 4 MB read window in 1 MB steps is ~15% faster


def new(algorithm: str) -> Any:
    """A streaming hasher (``update``, ``hexdigest``) for ``sha256``, ``xxh3_128`` or ``md5``."""
    if algorithm == FAST:
        return xxhash.xxh3_128()
    if algorithm == "md5":
        return hashlib.md5(usedforsecurity=False)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash {algorithm!r}; one of {', '.join(ALGORITHMS)}")


def digest(algorithm: str, data: Any) -> str:
    """Hex digest of a buffer (bytes, mmap, memoryview). ``update`` releases the GIL; a one-call
    ``hashlib.sha256(data)`` does not on 3.11."""
    h = new(algorithm)
    h.update(data)
    return h.hexdigest()  # type: ignore[no-any-return]


def xxh3_128(data: Any) -> str:
    return digest(FAST, data)


def sha256(data: Any) -> str:
    return digest("sha256", data)


class MultiHasher:
    """Several digests of one stream, fed once (the split hashes each shard as it writes it)."""

    def __init__(self, algorithms: Iterable[str] = ("sha256", FAST)) -> None:
        self._hashers = {a: new(a) for a in algorithms}
        self._updates = [h.update for h in self._hashers.values()]

    def update(self, data: Any) -> None:
        """Feed a buffer of bytes (``bytes``, ``mmap``, a flat ``memoryview``)."""
        n = len(data)
        if n <= _PIECE:
            for u in self._updates:
                u(data)
            return
        view = memoryview(data)
        for i in range(0, n, _PIECE):
            piece = view[i : i + _PIECE]
            for u in self._updates:
                u(piece)

    def hexdigests(self) -> dict[str, str]:
        return {a: h.hexdigest() for a, h in self._hashers.items()}


class ChunkHasher:
    """xxh3-128 of each chunk of a stream, cut where the caller says: the split cuts a shard at
    sample boundaries, so every chunk can later be fetched, checked and parsed alone."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self._n = 0
        self.sizes: list[int] = []
        self.digests: list[str] = []

    def update(self, data: Any) -> None:
        self._h.update(data)
        self._n += len(data)

    @property
    def pending(self) -> int:
        """Bytes fed since the last cut."""
        return self._n

    def cut(self) -> None:
        """End the current chunk (nothing if it is empty)."""
        if self._n:
            self.sizes.append(self._n)
            self.digests.append(self._h.hexdigest())
            self._h = xxhash.xxh3_128()
            self._n = 0


def file_digests(path: Path, *algorithms: str) -> tuple[dict[str, str], int]:
    """Hex digests of a file in one pass over its bytes, and its size."""
    hasher = MultiHasher(algorithms)
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        while got := f.readinto(buf):
            hasher.update(view[:got])
            n += got
    return hasher.hexdigests(), n


def verify_digest(data: Any, *, sha256_hex: str, xxh3_hex: str, mode: str) -> bool:
    """Whether ``data`` matches the manifest's digests under ``mode`` (the length is checked apart).

    ``"xxh3"`` checks the fast hash, or sha256 where the manifest predates it; ``"sha256"`` always
    sha256; ``"size"`` nothing here."""
    if mode == "size":
        return True
    if mode == "xxh3" and xxh3_hex:
        return xxh3_128(data) == xxh3_hex
    return sha256(data) == sha256_hex


__all__ = ["ALGORITHMS", "FAST", "ChunkHasher", "MultiHasher", "digest", "file_digests", "new", "sha256", "verify_digest", "xxh3_128"]
