"""A fetched shard in memory, indexed once so that any of its samples can be cut out by position.

How a shard is indexed is its format's (``format_spec(fmt).index``): WebDataset tars column-wise
with numpy where they are uniform, TFRecord frames by their length fields. The shard's bytes were
checked against the manifest when they were fetched (sha256, or the size with ``verify="size"``),
so the per-header checksums and per-record CRCs are not checked again: they would only re-prove it.

``buf`` may be any buffer (``bytes``, ``mmap``, a read-only ``memoryview``). Fields come out as
``bytes``, one copy each, or with ``copy=False`` as read-only ``memoryview`` slices of ``buf``
(``np.frombuffer(field, np.uint8)`` is then a numpy view): no byte is touched until the consumer
reads it.

**Lifetime of a view.** A view holds ``buf`` alive, whatever happens to the ``Shard``: a mapped
local shard stays mapped (the ``mmap`` cannot be closed while a view exists), a fetched shard's
``bytes`` stay in memory. The bytes never change under a view, because the local replica only
ever renames files over or unlinks them (eviction, a corrupt copy), never rewrites or truncates
them in place: a mapping keeps the inode it was made from. (Truncating a replica file from
outside geoshard would make reading a view fault, as for any mapped file.) Holding views holds
their whole shard: keep them for a batch, and copy what must live longer.
"""

from __future__ import annotations

from typing import Any

from geoshard.errors import DataError
from geoshard.formats import format_spec

RawSample = dict[str, Any] | bytes | memoryview


class Shard:
    """The samples of one shard: ``len(shard)`` and ``shard.sample(i)``."""

    __slots__ = ("_columns", "_fields", "_keys", "_out", "_spans", "buf", "path")

    def __init__(self, path: str, buf: Any, fmt: str, copy: bool = True, expected: int | None = None) -> None:
        self.path = path
        index = format_spec(fmt, path).load.index(buf, path)
        self.buf = index.buf  # the shard, or (foreign tars) its fields copied out once
        self._keys = index.keys
        self._columns = index.columns  # (field, starts, ends): uniform tars
        self._fields = index.fields  # per sample: other tars
        self._spans = index.spans  # TFRecord
        if expected is not None and len(self) != expected:  # the bytes matched their hash: the manifest is wrong
            raise DataError(f"{path}: holds {len(self)} samples where its manifest says {expected}; run geoshard verify on the split")
        self._out: Any = self.buf if copy else memoryview(self.buf).toreadonly()

    def __len__(self) -> int:
        return len(self._spans) if self._spans else len(self._keys)

    def sample(self, i: int) -> RawSample:
        buf = self._out
        if self._columns is not None:
            out: dict[str, Any] = {"__key__": self._keys[i]}
            for ext, starts, ends in self._columns:
                out[ext] = buf[starts[i] : ends[i]]
            return out
        if self._spans:
            s, e = self._spans[i]
            return buf[s:e]  # type: ignore[no-any-return]
        out = {"__key__": self._keys[i]}
        for ext, s, e in self._fields[i]:
            out[ext] = buf[s:e]
        return out
