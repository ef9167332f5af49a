"""Reading a manifest file without holding all of it: the top-level object's values are parsed
one by one from a window of decoded text, and a version 1 ``shards`` list one shard at a time.

A version 1 region manifest is mostly chunk hashes (about 6.5 KB a shard); parsing it whole holds
its bytes, its text and every chunk's objects at once. Streamed, each shard's chunks become their
binary index (``chunkindex``) as soon as they are parsed, and only the window is text.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import IO, Any

from geoshard.errors import DataError
from geoshard.manifest import checks

_PIECE = 1 << 20
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Window:
    """Decoded text of a binary file from ``pos`` on, read as the parser needs it."""

    def __init__(self, f: IO[bytes], name: str) -> None:
        self.f, self.name = f, name
        self.decode = codecs.getincrementaldecoder("utf-8")().decode
        self.buf, self.pos, self.eof = "", 0, False

    def more(self, rest: bool = False) -> bool:
        """Read a piece more, or with ``rest`` all that is left."""
        if self.eof:
            return False
        data = self.f.read() if rest else self.f.read(_PIECE)
        self.eof = not data or rest
        try:
            text = self.decode(data, final=self.eof)
        except UnicodeDecodeError as e:
            raise DataError(f"{self.name}: unreadable manifest: {e}") from e
        del data  # before the text is joined: at most two copies of the rest are held at once
        self.buf, self.pos = self.buf[self.pos :] + text, 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ("" at the end)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos : self.pos + 1]

    def expect(self, chars: str) -> str:
        c = self.peek()
        if not c or c not in chars:
            raise DataError(f"{self.name}: unreadable manifest: expected one of {chars!r} at {c or 'the end'!r}")
        self.pos += 1
        return c

    def value(self) -> Any:
        """The next JSON value. A number at the window's end may go on past it: taken only once
        something follows it, as something always does inside an object."""
        self.peek()
        tries = 0
        while True:
            try:
                v, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                tries += 1
                if self.more(rest=tries > 1):  # a value longer than a piece (version 2 columns): parsed once more, whole
                    continue
                raise DataError(f"{self.name}: unreadable manifest: {e}") from e
            if end < len(self.buf) or not self.more(rest=tries > 1):
                self.pos = end
                return v


def load(f: IO[bytes], name: str, on_shard: Callable[[Any, int, dict[str, Any]], None]) -> dict[str, Any]:
    """The top-level object of a manifest file. A ``shards`` list is handed to ``on_shard`` one
    element at a time (with its index and the values read before the list) and kept as None; any other value is kept as parsed."""
    w = _Window(f, name)
    out: dict[str, Any] = {}
    try:
        if w.peek() != "{":  # not an object: refused as the whole-document check words it
            checks.mapping(w.value(), "the manifest", name)
        w.expect("{")
        if w.peek() == "}":
            w.pos += 1
        else:
            while True:
                key = w.value()
                if not isinstance(key, str):
                    raise DataError(f"{name}: unreadable manifest: a key must be a string, got {key!r}")
                w.expect(":")
                if key == "shards" and w.peek() == "[":
                    _shards(w, on_shard, out)
                    out[key] = None
                else:
                    out[key] = w.value()
                if w.expect(",}") == "}":
                    break
        if w.peek():
            raise DataError(f"{name}: unreadable manifest: extra data after the top-level object")
    except RecursionError:
        raise DataError(f"{name}: not a geoshard manifest (nested deeper than Python's JSON parser allows)") from None
    return out


def _shards(w: _Window, on_shard: Callable[[Any, int, dict[str, Any]], None], before: dict[str, Any]) -> None:
    w.expect("[")
    if w.peek() == "]":
        w.pos += 1
        return
    i = 0
    while True:
        on_shard(w.value(), i, before)
        i += 1
        if w.expect(",]") == "]":
            return
