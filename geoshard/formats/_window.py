"""A sliding read window over a binary stream, shared by the streaming readers.

Readers parse records straight out of ``buf`` between ``pos`` and ``len(buf)``; when a record
needs more bytes they call :meth:`fill`. Memory stays bounded by one record plus one chunk.
"""

from __future__ import annotations

from typing import Protocol

CHUNK = 1 << 20
_MAX_READ = 64 << 20  # one read() call asks for at most this: a declared size never sizes an allocation


class Readable(Protocol):
    """What the readers need of a stream: files, gzip streams, S3 bodies and hashing wrappers all fit."""

    def read(self, n: int = -1, /) -> bytes: ...


class Window:
    __slots__ = ("base", "buf", "chunk", "f", "pos", "size")

    def __init__(self, f: Readable, chunk: int = CHUNK, size: int | None = None) -> None:
        """``size``: the stream's length when known (a plain file): a record or member that
        declares more than is left fails at once, without reading or allocating it."""
        self.f = f
        self.size = size
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
            more = self.f.read(min(max(self.chunk, n - have), _MAX_READ))
            if not more:
                break
            parts.append(more)
            have += len(more)
        self.buf = b"".join(parts)
        return have >= n

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def fits(self, n: int) -> bool:
        """Whether ``n`` bytes from ``pos`` can exist: False when the stream's known size says no."""
        return self.size is None or self.offset + n <= self.size

    def left(self) -> int:
        """Bytes from ``pos`` to the end of the stream as far as known (read, or its known size)."""
        return self.size - self.offset if self.size is not None else self.remaining()
