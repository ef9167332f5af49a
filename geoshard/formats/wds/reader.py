"""Reading WebDataset tar shards: members grouped into samples exactly as webdataset groups them.

The key of a member is its path up to the first dot of its basename; consecutive members with
one key form a sample. Fields are kept byte-identical.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Iterator

from geoshard.errors import DataError
from geoshard.formats._window import Readable, ReusedWindow, Window
from geoshard.formats.keys import check_key
from geoshard.formats.wds.tarscan import scan
from geoshard.formats.wds.writer import BLOCK, CHECKSUM_SPACES, ZERO_BLOCK, Member, member_header

EXTENSIONS = (".tar",)
_adler = zlib.adler32

OnUnterminated = Callable[[int], None]  # called with the offset where a tar without end blocks stops
# A sample as the split moves it: its key and its members as compact tar bytes (each member one
# header block, data, padding), ready to append to an output shard without re-encoding.
RawSample = tuple[bytes, bytes]
_REGULAR = (0x30, 0x00, 0x37)  # '0', NUL (old tar), '7' (contiguous)
CHUNK = 4 << 20  # read window; big enough that the vectorized scan amortizes its fixed cost


def _octal(field: bytes, what: str, name: str, offset: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes over 8 GB
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.strip(b"\0 ") or b"0", 8)
    except ValueError:
        raise DataError(f"{name}: invalid tar {what} field at byte {offset}; not a tar file or corrupted") from None


def _parse_pax(data: bytes) -> dict[bytes, bytes]:
    out = {}
    pos = 0
    while pos < len(data):
        sp = data.index(b" ", pos)
        length = int(data[pos:sp])
        kv = data[sp + 1 : pos + length - 1]
        k, _, v = kv.partition(b"=")
        out[k] = v
        pos += length
    return out


def _members(w: Window, name: str, unterminated: OnUnterminated | None = None) -> Iterator[tuple[bytes, bytes, int, int]]:
    """Member by member: ``(member name, raw, data size, header offset)``.

    ``raw`` is the member as one header block, data and padding: the input's own bytes when its
    header is a single block, else re-encoded compactly. A stream that ends at a member boundary
    without the end-of-archive blocks is a DataError (a tar cut there looks whole otherwise),
    unless ``unterminated`` is given: it is called with the stream offset, and the members end.
    """
    long_name: bytes | None = None
    first = w.offset == 0
    while True:
        if w.pos + BLOCK > len(w.buf) and not _fill_header(w, name, first, unterminated):
            return
        pos, buf = w.pos, w.buf
        if buf[pos] == 0 and buf[pos : pos + BLOCK] == ZERO_BLOCK:
            if first:
                raise DataError(f"{name}: starts with an empty block; not a tar archive")
            w.pos = len(w.buf)
            return
        _check_header(buf, pos, name, w.offset, first)
        first = False
        size = _octal(buf[pos + 124 : pos + 136], "size", name, w.offset)
        typeflag = buf[pos + 156]
        end = pos + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))
        if end > len(buf):
            end = _fill_member(w, name, size)
            pos, buf = w.pos, w.buf
        header_offset = w.base + pos
        w.pos = min(end, len(buf))
        if typeflag in _REGULAR:
            member, raw = _regular(buf, pos, end, size, long_name)
            long_name = None
            yield member, raw, size, header_offset
        elif typeflag == 0x78:  # 'x': PAX header of the next member
            long_name = _parse_pax(buf[pos + BLOCK : pos + BLOCK + size]).get(b"path", long_name)
        elif typeflag == 0x4C:  # 'L': GNU long name of the next member
            long_name = buf[pos + BLOCK : pos + BLOCK + size].split(b"\0", 1)[0]
        else:
            long_name = None  # directories, links, global PAX headers: not sample members


def _fill_header(w: Window, name: str, first: bool, unterminated: OnUnterminated | None) -> bool:
    """Make a header block available; False at a stream end that ``unterminated`` accepts."""
    if w.fill(BLOCK):
        return True
    if w.remaining():
        raise DataError(f"{name}: truncated tar at byte {w.offset}: partial header")
    if first:
        raise DataError(f"{name}: empty file; not a tar archive")
    if unterminated is None:
        raise DataError(
            f"{name}: tar ends at byte {w.offset} without end-of-archive blocks; truncated? (--allow-truncated-tar splits what it holds)"
        )
    unterminated(w.offset)
    return False


def _check_header(buf: bytes, pos: int, name: str, offset: int, first: bool) -> None:
    # The byte sum with the checksum field read as spaces. adler32's low half is 1 + that sum
    # mod 65521, which checks it at C speed.
    try:
        chk = int(buf[pos + 148 : pos + 156].strip(b"\0 "), 8)
    except ValueError:
        chk = -1
    if (_adler(buf[pos + 156 : pos + BLOCK], _adler(CHECKSUM_SPACES, _adler(buf[pos : pos + 148]))) & 0xFFFF) != (chk + 1) % 65521:
        what = "not a tar archive" if first else "corrupted tar header"
        raise DataError(f"{name}: bad tar header checksum at byte {offset}; {what}")


def _fill_member(w: Window, name: str, size: int) -> int:
    """Read the rest of the member at ``w.pos`` into ``w.buf``; its end (padding included) there."""
    end = w.pos + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))
    offset = w.offset
    if w.fits(BLOCK + size):  # a declared size beyond the known end is not read (nor allocated)
        w.fill(end - w.pos)
    if w.remaining() < BLOCK + size:
        raise DataError(f"{name}: truncated tar at byte {offset}: member declares {size} bytes")
    return w.pos + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))


def _regular(buf: bytes, pos: int, end: int, size: int, long_name: bytes | None) -> tuple[bytes, bytes]:
    """A regular member's name and compact raw bytes (re-encoded when its name needed more than one block)."""
    if long_name is not None:
        return long_name, member_header(long_name, size) + buf[pos + BLOCK : pos + BLOCK + size] + bytes(-size % BLOCK)
    nul = buf.find(b"\0", pos, pos + 100)
    member = buf[pos : nul if nul >= 0 else pos + 100]
    if buf[pos + 345] != 0 and buf[pos + 257 : pos + 262] == b"ustar":
        member = buf[pos + 345 : pos + 500].split(b"\0", 1)[0] + b"/" + member
        raw = member_header(member, size) + buf[pos + BLOCK : end]
    else:
        raw = buf[pos:end]
    return member, raw + bytes(end - pos - len(raw))  # a final member without padding


def _slow_samples(w: Window, name: str, unterminated: OnUnterminated | None = None) -> Iterator[RawSample]:
    """Group members into samples one member at a time (any tar dialect, precise errors)."""
    key: bytes | None = None
    parts: list[bytes] = []
    names: set[bytes] = set()
    for member, raw, _, offset in _members(w, name, unterminated):
        slash = member.rfind(b"/") + 1
        dot = member.find(b".", slash)
        if dot <= slash:
            base = member[slash:]
            if base.startswith(b"__") and base.endswith(b"__"):
                continue  # webdataset skips metadata members such as __index__
            raise DataError(
                f"{name}: tar member {member.decode(errors='replace')!r} at byte {offset} belongs to no sample "
                "(its basename has no '.ext' after the key)"
            )
        k = member[:dot]
        if k != key:
            if key is not None:
                yield key, b"".join(parts)
            check_key(k, name)
            if k.startswith(b"/") or b".." in k.split(b"/"):
                raise DataError(
                    f"{name}: tar member {member.decode(errors='replace')!r} at byte {offset} has an absolute path or a '..' "
                    "part; refused (a reader extracting the shard would write outside its folder)"
                )
            key, parts, names = k, [], set()
        elif member in names:
            raise DataError(
                f"{name}: duplicate sample key {k.decode(errors='replace')!r}: field "
                f"{member[dot + 1 :].decode(errors='replace')!r} appears twice"
            )
        names.add(member)
        parts.append(raw)
    if key is not None:
        yield key, b"".join(parts)


def iter_raw_windows(
    f: Readable, name: str, unterminated: OnUnterminated | None = None, size: int | None = None, reuse: bool = False
) -> Iterator[tuple[bytes | memoryview, list[bytes], list[int], list[int]]]:
    """Yield batches ``(buf, keys, starts, ends)``: sample i is ``buf[starts[i]:ends[i]]``.

    Windows of plain ustar members go through the vectorized scanner; at the first window it
    declines (PAX headers, long names, metadata members, errors) the rest of the stream is read
    member by member, which also gives the precise error message. Batches let hot loops slice
    samples out of one buffer without a generator step per sample.

    ``reuse``: read into one kept buffer (:class:`ReusedWindow`, a copy less per byte); ``buf`` is
    then a memoryview valid only until the next batch is asked for. Keys are ``bytes`` either way.
    """
    w: Window | ReusedWindow = ReusedWindow(f, CHUNK, size) if reuse else Window(f, CHUNK, size)
    while True:
        more = w.fill(CHUNK)
        r = scan(w.buf, w.pos, eof=not more)
        if r is None:
            for key, raw in _slow_samples(w.detach() if isinstance(w, ReusedWindow) else w, name, unterminated):
                yield raw, [key], [0], [len(raw)]
            return
        yield w.buf, r.keys, r.starts, r.ends
        w.pos = r.consumed
        if r.end_of_archive:
            return


def iter_raw_samples(f: Readable, name: str, unterminated: OnUnterminated | None = None) -> Iterator[RawSample]:
    """Yield ``(key, raw)`` per sample, grouped exactly as webdataset groups members."""
    for buf, keys, starts, ends in iter_raw_windows(f, name, unterminated):
        for key, start, end in zip(keys, starts, ends, strict=True):
            yield key, bytes(buf[start:end])  # already bytes (no reuse here): bytes() returns it as is


def raw_members(raw: bytes) -> list[Member]:
    """The ``(member name, data)`` pairs of a raw sample."""
    out = []
    for member, mraw, size, _ in _members(Window(io.BytesIO(raw)), "sample", _ignore):  # a sample has no end blocks
        start = len(mraw) - ((size + BLOCK - 1) & ~(BLOCK - 1))  # data follows the header block(s)
        out.append((member, mraw[start : start + size]))
    return out


def _ignore(offset: int) -> None:
    pass


def iter_samples(f: Readable, name: str) -> Iterator[tuple[bytes, list[Member]]]:
    """``(key, [(member name, data), ...])`` per sample; convenient, slower than raw samples."""
    for key, raw in iter_raw_samples(f, name):
        yield key, raw_members(raw)


def sample_fields(members: list[Member]) -> dict[str, bytes]:
    """A sample's fields by extension, as webdataset names them (``{"jpg": b"..."}``)."""
    out = {}
    for member, data in members:
        slash = member.rfind(b"/") + 1
        out[member[member.find(b".", slash) + 1 :].decode("utf-8", "replace")] = data
    return out
