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


class ReusedWindow(Window):
    """A window that reads into one buffer it keeps, with ``readinto`` where the stream has it.

    :class:`Window` pays two copies per byte: ``read`` into a fresh object, then the join with
    what was left; here the bytes land once, in place (less CPU per byte: docs/benchmarks.md).
    The price is the lifetime: ``buf`` is a memoryview that the next :meth:`fill` overwrites, so a
    caller must be done with every view it cut from it (the split flushes its writers per window).
    :meth:`detach` hands the rest to a plain :class:`Window` (the member-by-member reader)."""

    __slots__ = ("_readinto", "_store")

    def __init__(self, f: Readable, chunk: int = CHUNK, size: int | None = None) -> None:
        super().__init__(f, chunk, size)
        self._store = bytearray(2 * chunk)  # a window plus what a sample left of the last one
        self._readinto = getattr(f, "readinto", None)
        # A memoryview where Window has bytes: the split's raw reader only slices it, and the
        # member-by-member reader, which needs bytes' methods, gets a plain Window (detach).
        self.buf = memoryview(self._store)[:0]  # type: ignore[assignment]

    def fill(self, n: int) -> bool:
        """As :meth:`Window.fill`; every view of the previous ``buf`` is overwritten."""
        have = len(self.buf) - self.pos
        if have >= n:
            return True
        store = self._store
        if self.pos:
            rest = self.buf[self.pos :]
            # bytearray slice assignment is a memcpy: overlapping ranges go through a copy.
            store[:have] = rest if have <= self.pos else bytes(rest)
        self.base += self.pos
        self.pos = 0
        while have < n:
            step = min(max(self.chunk, n - have), _MAX_READ)
            if have + step > len(store):  # only for records larger than the window; grows as bytes arrive
                grown = bytearray(max(have + step, 2 * len(store)))
                grown[:have] = memoryview(store)[:have]
                store = self._store = grown
            got = self._read(memoryview(store)[have : have + step])
            if not got:
                break
            have += got
        self.buf = memoryview(store)[:have]  # type: ignore[assignment]
        return have >= n

    def _read(self, into: memoryview) -> int:
        if self._readinto is not None:
            return self._readinto(into) or 0  # type: ignore[no-any-return]
        data = self.f.read(len(into))
        into[: len(data)] = data
        return len(data)

    def detach(self) -> Window:
        """A plain :class:`Window` over the same stream, holding a copy of the unparsed bytes."""
        w = Window(self.f, self.chunk, self.size)
        w.buf = bytes(self.buf[self.pos :])
        w.base = self.base + self.pos
        return w
