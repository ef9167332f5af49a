"""A fetched shard in memory, indexed once so that any of its samples can be cut out by position.

WebDataset tars as geoshard writes them (one ustar header block per member, every sample with the
same fields in the same order) are indexed column-wise: a few numpy passes over the header blocks
give, per field, the start and end of its data in every sample, so cutting a sample out is one
slice per field and no Python runs per member. Other tars go through the general vectorized tar
scanner, and tars it declines (PAX headers, long names) are read member by member. TFRecord frames
are walked by their length fields.

The shard's bytes were checked against the manifest when they were fetched (sha256, or the size
with ``verify="size"``), so the per-header checksums and per-record CRCs are not checked again:
they would only re-prove it. The structure is: every header must sit exactly where the previous
member ends, or the shard takes the general path, which also produces the precise error.

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

import io
import struct
from typing import Any

import numpy as np

from geoshard.errors import DataError
from geoshard.formats import wds
from geoshard.formats.tarscan import scan

_LEN = struct.Struct("<Q")
BLOCK = 512
_MAGIC = int.from_bytes(b"ustar\x0000", "little")  # bytes 257..264 of a POSIX ustar header
_NAME_GUESS = 32  # most member names are shorter; longer ones cost a second gather of 100 columns
RawSample = dict[str, Any] | bytes | memoryview


class Shard:
    """The samples of one shard: ``len(shard)`` and ``shard.sample(i)``."""

    __slots__ = ("_columns", "_fields", "_keys", "_out", "_spans", "buf", "path")

    def __init__(self, path: str, buf: Any, fmt: str, copy: bool = True, expected: int | None = None) -> None:
        self.path = path
        self.buf = buf
        self._out: Any = None  # what fields are sliced from: buf (copies) or a memoryview of it (views)
        self._keys: list[str] = []
        self._columns: list[tuple[str, list[int], list[int]]] | None = None  # (field, starts, ends): uniform tars
        self._fields: list[list[tuple[str, int, int]]] = []  # per sample: other tars
        self._spans: list[tuple[int, int]] = []  # TFRecord
        if fmt == "tfrecord":
            self._index_tfrecord()
        elif fmt == "wds":
            if not self._index_columns():
                self._index_tar()
        else:
            raise DataError(f"{path}: unknown shard format {fmt!r}")
        if expected is not None and len(self) != expected:  # the bytes matched their hash: the manifest is wrong
            raise DataError(f"{path}: holds {len(self)} samples where its manifest says {expected}; run geoshard verify on the split")
        self._out = self.buf if copy else memoryview(self.buf).toreadonly()

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

    def _index_tfrecord(self) -> None:
        buf, pos, n = self.buf, 0, len(self.buf)
        spans = self._spans
        unpack = _LEN.unpack_from
        while pos < n:
            if pos + 12 > n:
                raise DataError(f"{self.path}: truncated TFRecord at byte {pos}")
            (length,) = unpack(buf, pos)
            end = pos + 12 + length + 4
            if end > n:
                raise DataError(f"{self.path}: truncated TFRecord at byte {pos}: record declares {length} bytes")
            spans.append((pos + 12, pos + 12 + length))
            pos = end

    def _index_columns(self) -> bool:
        """Index a compact, uniform tar with numpy alone; False leaves it to the general scanner."""
        buf = self.buf
        nblocks, tail = divmod(len(buf), BLOCK)
        if nblocks < 2 or tail:
            return False
        a = np.frombuffer(buf, dtype=np.uint8).reshape(nblocks, BLOCK)
        cand = np.flatnonzero(a[:, 257] == 117)  # "u" of "ustar": one column first, the whole magic on the few that match
        cand = cand[np.ascontiguousarray(a[cand, 257:265]).view("<u8").ravel() == _MAGIC]
        m = len(cand)
        if m == 0 or cand[0] != 0:
            return False
        size_field = a[cand, 124:136]  # 11 octal digits, then NUL or space (GNU base-256 sizes fail the digit test)
        digits = size_field[:, :11] - np.uint8(48)
        if digits.max() >= 8 or not ((size_field[:, 11] == 0) | (size_field[:, 11] == 32)).all():
            return False
        typeflag = a[cand, 156]
        if not (((typeflag == 48) | (typeflag == 0)).all() and not a[cand, 345].any()):
            return False  # only regular files, no prefix field
        sizes = digits[:, 0].astype(np.int64)
        for c in range(1, 11):
            sizes = sizes * 8 + digits[:, c]
        nxt = cand + 1 + (sizes + BLOCK - 1) // BLOCK
        end = int(nxt[-1])
        if not np.array_equal(nxt[:-1], cand[1:]) or end >= nblocks or a[end:].any():
            # Not one chain of members followed by zero blocks (none at all: cut at a member
            # boundary?): the general path decides, as the reference reader does, and names the error.
            return False
        keys, columns = _names(a, cand)
        if keys is None:
            return False
        data = (cand + 1) * BLOCK
        k = len(columns)
        starts, ends = data.reshape(-1, k).T, (data + sizes).reshape(-1, k).T
        self._keys = keys
        self._columns = [(f, s.tolist(), e.tolist()) for f, s, e in zip(columns, starts, ends, strict=True)]
        return True

    def _index_tar(self) -> None:
        r = scan(self.buf, 0, eof=True, members=True)
        if r is None or r.members is None or not r.end_of_archive:
            self._index_tar_slowly()
            return
        m = r.members
        decoded = {e: e.decode("utf-8", "replace") for e in set(m.ext)}
        names = [decoded[e] for e in m.ext]
        data, size, first = m.data.tolist(), m.size.tolist(), m.first.tolist()
        self._keys = [k.decode("utf-8") for k in r.keys]
        fields = self._fields
        for i in range(len(first) - 1):
            fields.append([(names[j], data[j], data[j] + size[j]) for j in range(first[i], first[i + 1])])

    def _index_tar_slowly(self) -> None:
        # Rare (foreign tars): the fields are copied out once, positions then point into them.
        parts: list[bytes] = []
        offset = 0
        for key, members in wds.iter_samples(io.BytesIO(self.buf), self.path):
            self._keys.append(key.decode("utf-8"))
            fields = []
            for ext, value in wds.sample_fields(members).items():
                parts.append(value)
                fields.append((ext, offset, offset + len(value)))
                offset += len(value)
            self._fields.append(fields)
        self.buf = b"".join(parts)


def _names(a: np.ndarray, cand: np.ndarray) -> tuple[list[str] | None, list[str]]:
    """Sample keys and field names of members whose names are ``key.field``, grouped as webdataset
    groups them, if every sample has the same fields in the same order; (None, []) otherwise."""
    width = _NAME_GUESS
    names = a[cand, :width]
    nul = names == 0
    if not nul.any(axis=1).all():  # a name longer than the guess: look at the whole field
        width = 100
        names = a[cand, :width]
        nul = names == 0
    name_len = np.where(nul.any(axis=1), np.argmax(nul, axis=1), width)
    if (((names - np.uint8(32)) >= 95) & ~nul).any():
        return None, []  # control characters (an error) or non-ASCII names: the general path checks them
    cols = np.arange(width, dtype=np.int16)
    dots = names == 46
    slashes = names == 47
    if slashes.any():  # the key is everything up to the first dot of the basename
        slash = np.where(slashes & (cols < name_len[:, None]), cols, -1).max(axis=1)
        dots &= cols > slash[:, None]
    else:
        slash = np.full(len(cand), -1)
    dot = np.argmax(dots, axis=1)
    if not (dots.any(axis=1).all() and (dot < name_len).all() and (dot > slash + 1).all()):
        return None, []  # a member without a key.ext name: metadata or an error
    fixed = bool((dot == dot[0]).all())
    if fixed:  # keys of one length (zero-padded numbers): plain column ranges
        d = int(dot[0])
        key_s = np.ascontiguousarray(names[:, :d]).view(f"S{d}").ravel()
    else:
        key_s = np.where(cols < dot[:, None], names, 0).view(f"S{width}").ravel()
    boundary = np.flatnonzero(key_s[1:] != key_s[:-1]) + 1
    k = int(boundary[0]) if len(boundary) else len(cand)  # members per sample, if all samples have the same number
    if len(cand) % k or not np.array_equal(boundary, np.arange(k, len(cand), k)):
        return None, []
    if fixed:
        ext_s = np.ascontiguousarray(names[:, d + 1 :]).view(f"S{width - d - 1}").reshape(-1, k)
    else:  # each member's field name moved to column 0, so names after keys of any length compare equal
        ext_len = name_len - dot - 1
        ecols = np.arange(max(int(ext_len.max()), 1))
        src = np.minimum(dot[:, None] + 1 + ecols, width - 1)
        ext = np.where(ecols < ext_len[:, None], np.take_along_axis(names, src, axis=1), 0)
        ext_s = ext.view(f"S{len(ecols)}").reshape(-1, k)
    fields = [e.decode("ascii") for e in ext_s[0].tolist()]
    if len(set(fields)) != k or not (ext_s == ext_s[0]).all():
        return None, []  # a field repeated in a sample, or samples with different fields
    return [key.decode("ascii") for key in key_s[::k].tolist()], fields
