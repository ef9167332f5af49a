"""Vectorized scanning of ustar tar buffers into WebDataset samples.

Per-member Python work dominates tar reading at small sample sizes (webdataset's own reader spends
most of its time there). Here a whole read window is parsed at once with numpy: header blocks are found by their
``ustar`` magic, sizes and checksums are decoded for all of them together, and the candidates are
accepted only if they chain exactly (each member's end is the next header), so a data block that
happens to contain ``ustar`` can never be mistaken for a header. Samples come out as contiguous
byte spans. Anything unusual (PAX or GNU long names, prefix fields, non-regular members, odd
numeric fields, keys needing checks) makes :func:`scan` return None and the caller falls back to
the member-by-member reader for that window, which also produces the precise error message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 512
_POW8_11 = 8 ** np.arange(10, -1, -1, dtype=np.int64)
_POW8_6 = 8 ** np.arange(5, -1, -1, dtype=np.int64)
_COLS100 = np.arange(100)


@dataclass(frozen=True)
class ScanResult:
    keys: list[bytes]
    starts: list[int]  # absolute offset in buf of each sample's first header
    ends: list[int]  # absolute offset in buf just past each sample's last member
    consumed: int  # offset in buf up to which samples were emitted
    end_of_archive: bool
    members: Members | None = None  # only when asked for: the loaders index fields without a Python loop over headers


@dataclass(frozen=True)
class Members:
    """Member-level view of the emitted samples: member j of sample ``sample[j]``."""

    data: np.ndarray  # absolute offset of each member's data
    size: np.ndarray
    ext: list[bytes]  # the field name: the member name after the key's dot
    first: np.ndarray  # index of each sample's first member; ``first[i+1]`` ends sample i


def scan(buf: bytes | memoryview, pos: int, eof: bool, members: bool = False) -> ScanResult | None:
    """Parse the complete samples of ``buf[pos:]``; None means: use the slow reader here."""
    nblocks = (len(buf) - pos) // BLOCK
    if nblocks < 2:
        return None
    a = np.frombuffer(buf, dtype=np.uint8, count=nblocks * BLOCK, offset=pos).reshape(nblocks, BLOCK)
    chain = _chain(a)
    if chain is None:
        return None
    cand, h, sizes, nxt = chain
    # Members wholly inside the window; the last may be cut off.
    complete = int(np.count_nonzero(nxt <= nblocks))
    end_of_archive = False
    if complete == len(cand) and nxt[-1] < nblocks:
        if a[nxt[-1]].any():
            return None  # something other than a ustar header follows
        end_of_archive = True
    if complete == 0:
        return None
    named = _names(h[:complete])
    if named is None:
        return None
    names, cols, key_len, key_s, firsts = named
    # The last sample may continue in the next window unless the archive or the stream ended.
    last_done = end_of_archive or (eof and complete == len(cand) and nxt[-1] == nblocks)
    nsamples = len(firsts) if last_done else len(firsts) - 1
    if nsamples <= 0:
        return None
    member_end = pos + nxt[:complete] * BLOCK
    starts = (pos + cand[firsts[:nsamples]] * BLOCK).tolist()
    ends = member_end[np.append(firsts[1:], complete)[:nsamples] - 1].tolist()
    # Keys as bytes from the masked names (NUL-padded, which tolist strips; a key holds no NUL):
    # never slices of ``buf``, which may be a reused buffer's memoryview.
    out = key_s[firsts[:nsamples]].tolist()
    m = None
    if members:
        nm = int(np.append(firsts, complete)[nsamples])  # members of the emitted samples
        ext_cols = np.where(cols > key_len[:nm, None], names[:nm], 0)  # keep only the bytes after the key's dot
        ext_s = np.ascontiguousarray(ext_cols).view(f"S{names.shape[1]}").ravel()
        m = Members(
            data=pos + (cand[:nm] + 1) * BLOCK,
            size=sizes[:nm],
            ext=[e.lstrip(b"\0") for e in ext_s.tolist()],
            first=np.append(firsts[:nsamples], nm),
        )
    return ScanResult(keys=out, starts=starts, ends=ends, consumed=ends[-1], end_of_archive=end_of_archive and last_done, members=m)


def _chain(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The plain ustar headers among the blocks ``a``, if they chain exactly from the first block:
    (their block indices, their header blocks, data sizes, block index after each member)."""
    magic = a[:, 257] == 117  # "ustar", compared column by column: cheaper than a 2-D compare
    for i, c in enumerate(b"star", start=258):
        magic &= a[:, i] == c
    cand = np.flatnonzero(magic)
    if len(cand) < 2 or cand[0] != 0:
        return None
    h = a[cand]
    size_d = h[:, 124:135].astype(np.int64) - 48
    if not (((size_d >= 0) & (size_d < 8)).all() and ((h[:, 135] == 0) | (h[:, 135] == 32)).all()):
        return None
    sizes = size_d @ _POW8_11
    nxt = cand + 1 + (sizes + BLOCK - 1) // BLOCK
    if not np.array_equal(nxt[:-1], cand[1:]):
        return None  # not one chain: some candidate sits inside data, or a non-ustar header intervenes
    # Checksum as the common writers store it ("%06o\0 "): compare digits rather than parse them.
    total = np.add.reduce(h, axis=1, dtype=np.uint32).astype(np.int64)
    chk = total - np.add.reduce(h[:, 148:156], axis=1, dtype=np.uint32).astype(np.int64) + 8 * 32
    digits = (chk[:, None] // _POW8_6) % 8 + 48
    if not ((digits == h[:, 148:154]).all() and (h[:, 154] == 0).all()):
        return None
    if not (((h[:, 156] == 48) | (h[:, 156] == 0)).all() and (h[:, 345] == 0).all()):
        return None
    return cand, h, sizes, nxt


def _names(h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Member names of the header blocks ``h`` as samples: (names, their columns, key lengths,
    keys, index of each sample's first member); None when the slow path must decide."""
    complete = len(h)
    nonzero = h[:, :100] != 0
    name_len = np.where(nonzero.all(axis=1), 100, np.argmin(nonzero, axis=1))
    width = int(name_len.max())  # names are short in practice: work on their columns only
    cols = _COLS100[:width]
    names = np.ascontiguousarray(h[:, :width])
    inside = cols < name_len[:, None]
    slash = np.where(inside & (names == 47), cols, -1).max(axis=1)
    dots = inside & (names == 46) & (cols > slash[:, None])
    key_len = np.argmax(dots, axis=1)
    if not dots.any(axis=1).all() or (key_len <= slash + 1).any():
        return None  # a member without a key.ext name (metadata or an error): slow path decides
    keys = names * (cols < key_len[:, None])
    if ((keys != 0) & ((keys < 32) | (keys >= 127))).any():
        return None  # control characters (an error) or non-ASCII keys (need a UTF-8 check)
    if (names[:, 0] == 47).any() or ((keys[:, 1:] == 46) & (keys[:, :-1] == 46)).any():
        return None  # an absolute path or '..' in a key: the slow path refuses it by name
    key_s = keys.view(f"S{width}").ravel()
    new_sample = np.ones(complete, dtype=bool)
    new_sample[1:] = key_s[1:] != key_s[:-1]
    sample_id = np.cumsum(new_sample)
    firsts = np.flatnonzero(new_sample)
    # A field repeated inside a sample is a repeated full name among that sample's members.
    name_s = names.view(f"S{width}").ravel()
    widest = int(np.diff(np.append(firsts, complete)).max())
    for lag in range(1, widest):
        if ((name_s[lag:] == name_s[:-lag]) & (sample_id[lag:] == sample_id[:-lag])).any():
            return None  # the slow path names the repeated field
    return names, cols, key_len, key_s, firsts
