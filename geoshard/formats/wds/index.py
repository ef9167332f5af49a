"""Indexing a fetched WebDataset shard: where each sample's fields lie in its bytes.

Tars as geoshard writes them (one ustar header block per member, every sample with the same fields
in the same order) are indexed column-wise: a few numpy passes over the header blocks give, per
field, the start and end of its data in every sample, so cutting a sample out is one slice per
field and no Python runs per member. Other tars go through the general vectorized tar scanner,
and tars it declines (PAX headers, long names) are read member by member.

The shard's bytes were checked against the manifest when they were fetched, so header checksums
are not checked again. The structure is: every header must sit exactly where the previous member
ends, or the shard takes the general path, which also produces the precise error.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from geoshard.formats.spec import ShardIndex
from geoshard.formats.wds.reader import iter_samples, sample_fields
from geoshard.formats.wds.tarscan import scan
from geoshard.formats.wds.writer import BLOCK

_MAGIC = int.from_bytes(b"ustar\x0000", "little")  # bytes 257..264 of a POSIX ustar header
_NAME_GUESS = 32  # most member names are shorter; longer ones cost a second gather of 100 columns


def index_tar(buf: Any, path: str) -> ShardIndex:
    """The samples of the tar shard ``buf``; ``path`` labels errors."""
    return _index_columns(buf) or _index_tar(buf, path)


def _index_columns(buf: Any) -> ShardIndex | None:
    """Index a compact, uniform tar with numpy alone; None leaves it to the general scanner."""
    nblocks, tail = divmod(len(buf), BLOCK)
    if nblocks < 2 or tail:
        return None
    a = np.frombuffer(buf, dtype=np.uint8).reshape(nblocks, BLOCK)
    cand = np.flatnonzero(a[:, 257] == 117)  # "u" of "ustar": one column first, the whole magic on the few that match
    cand = cand[np.ascontiguousarray(a[cand, 257:265]).view("<u8").ravel() == _MAGIC]
    m = len(cand)
    if m == 0 or cand[0] != 0:
        return None
    size_field = a[cand, 124:136]  # 11 octal digits, then NUL or space (GNU base-256 sizes fail the digit test)
    digits = size_field[:, :11] - np.uint8(48)
    if digits.max() >= 8 or not ((size_field[:, 11] == 0) | (size_field[:, 11] == 32)).all():
        return None
    typeflag = a[cand, 156]
    if not (((typeflag == 48) | (typeflag == 0)).all() and not a[cand, 345].any()):
        return None  # only regular files, no prefix field
    sizes = digits[:, 0].astype(np.int64)
    for c in range(1, 11):
        sizes = sizes * 8 + digits[:, c]
    nxt = cand + 1 + (sizes + BLOCK - 1) // BLOCK
    end = int(nxt[-1])
    if not np.array_equal(nxt[:-1], cand[1:]) or end >= nblocks or a[end:].any():
        # Not one chain of members followed by zero blocks (none at all: cut at a member
        # boundary?): the general path decides, as the reference reader does, and names the error.
        return None
    keys, columns = _names(a, cand)
    if keys is None:
        return None
    data = (cand + 1) * BLOCK
    k = len(columns)
    starts, ends = data.reshape(-1, k).T, (data + sizes).reshape(-1, k).T
    return ShardIndex(buf, keys, [(f, s.tolist(), e.tolist()) for f, s, e in zip(columns, starts, ends, strict=True)])


def _index_tar(buf: Any, path: str) -> ShardIndex:
    r = scan(buf, 0, eof=True, members=True)
    if r is None or r.members is None or not r.end_of_archive:
        return _index_tar_slowly(buf, path)
    m = r.members
    decoded = {e: e.decode("utf-8", "replace") for e in set(m.ext)}
    names = [decoded[e] for e in m.ext]
    data, size, first = m.data.tolist(), m.size.tolist(), m.first.tolist()
    fields: list[list[tuple[str, int, int]]] = []
    for i in range(len(first) - 1):
        fields.append([(names[j], data[j], data[j] + size[j]) for j in range(first[i], first[i + 1])])
    return ShardIndex(buf, [k.decode("utf-8") for k in r.keys], fields=fields)


def _index_tar_slowly(buf: Any, path: str) -> ShardIndex:
    # Rare (foreign tars): the fields are copied out once, positions then point into them.
    parts: list[bytes] = []
    offset = 0
    keys: list[str] = []
    samples: list[list[tuple[str, int, int]]] = []
    for key, members in iter_samples(io.BytesIO(buf), path):
        keys.append(key.decode("utf-8"))
        fields = []
        for ext, value in sample_fields(members).items():
            parts.append(value)
            fields.append((ext, offset, offset + len(value)))
            offset += len(value)
        samples.append(fields)
    return ShardIndex(b"".join(parts), keys, fields=samples)


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
