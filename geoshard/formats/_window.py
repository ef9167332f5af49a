"""A sliding read window over a binary stream, shared by the streaming readers.

Readers parse records straight out of ``buf`` between ``pos`` and ``len(buf)``; when a record
needs more bytes they call :meth:`fill`. Memory stays bounded by one record plus one chunk.
"""

from __future__ import annotations

from typing import Protocol

CHUNK = 1 << 20


class Readable(Protocol):
    """What the readers need of a stream: files, gzip streams, S3 bodies and hashing wrappers all fit."""

    def read(self, n: int = -1, /) -> bytes: ...


class Window:
    __slots__ = ("base", "buf", "chunk", "f", "pos")

    def __init__(self, f: Readable, chunk: int = CHUNK) -> None:
        self.f = f
        self.buf = b""
        self.pos = 0  # parse position inside buf
        self.base = 0  # stream offset of buf[0]
        self.chunk = chunk

    @property
    def offset(self) -> int:
        """Stream offset of ``pos``; error messages name it."""
        return self.base + self.pos

    def fill(self, n: int) -> bool:
        """Make ``n`` bytes available from ``pos``. False when the stream ends first."""
        have = len(self.buf) - self.pos
        if have >= n:
            return True
        parts = [self.buf[self.pos :]]
        self.base += self.pos
        self.pos = 0
        while have < n:
            more = self.f.read(max(self.chunk, n - have))
            if not more:
                break
            parts.append(more)
            have += len(more)
        self.buf = b"".join(parts)
        return have >= n

    def remaining(self) -> int:
        return len(self.buf) - self.pos
