"""WebDataset tar shards: members grouped into samples exactly as webdataset groups them.

The key of a member is its path up to the first dot of its basename; consecutive members with
one key form a sample. Fields are kept byte-identical. geoshard writes compact ustar headers
(no PAX unless a name needs it, mtime 0) so readers pay little per member.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from geoshard.errors import DataError
from geoshard.formats._window import Readable, Window

EXTENSIONS = (".tar",)
BLOCK = 512
_ZERO = bytes(BLOCK)
_SPACES = b" " * 8
_adler = zlib.adler32
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")

Member = tuple[bytes, bytes]  # (full member name, data): what writers take
RawMember = tuple[bytes, bytes, int, int]  # (name, raw header+data+padding, data size, offset)
SampleMember = tuple[bytes, bytes, int]  # (name, raw, data size)
Sample = tuple[bytes, list[SampleMember]]  # (key, members in tar order)
_REGULAR = (0x30, 0x00, 0x37)  # '0', NUL (old tar), '7' (contiguous)


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


def iter_members(f: Readable, name: str) -> Iterator[RawMember]:
    """Yield ``(member name, raw, size, header offset)`` for each regular file in the tar stream.

    ``raw`` is the member encoded as one compact header block, its data and padding: the input's own
    bytes when its header is a single block (one slice, no re-encoding), else re-encoded.
    """
    w = Window(f)
    long_name: bytes | None = None
    first = True
    adler = zlib.adler32
    while True:
        pos, buf = w.pos, w.buf
        if pos + BLOCK > len(buf):
            if not w.fill(BLOCK):
                if w.remaining():
                    raise DataError(f"{name}: truncated tar at byte {w.offset}: partial header")
                if first:
                    raise DataError(f"{name}: empty file; not a tar archive")
                return  # end of stream without end-of-archive blocks, as tarfile accepts
            pos, buf = w.pos, w.buf
        if buf[pos] == 0 and buf[pos : pos + BLOCK] == _ZERO:
            if first:
                raise DataError(f"{name}: starts with an empty block; not a tar archive")
            return
        # Header checksum: the byte sum with the checksum field read as spaces. adler32's low half is
        # 1 + that sum mod 65521, which checks it at C speed.
        try:
            chk = int(buf[pos + 148 : pos + 156].strip(b"\0 "), 8)
        except ValueError:
            chk = -1
        if (adler(buf[pos + 156 : pos + BLOCK], adler(_SPACES, adler(buf[pos : pos + 148]))) & 0xFFFF) != (chk + 1) % 65521:
            what = "not a tar archive" if first else "corrupted tar header"
            raise DataError(f"{name}: bad tar header checksum at byte {w.offset}; {what}")
        first = False
        field = buf[pos + 124 : pos + 136]
        size = int(field.strip(b"\0 ") or b"0", 8) if field[0] < 0x80 else _octal(field, "size", name, w.offset)
        typeflag = buf[pos + 156]
        end = pos + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))
        if end > len(buf):
            offset = w.offset
            if not w.fill(end - pos) and w.remaining() < BLOCK + size:
                raise DataError(f"{name}: truncated tar at byte {offset}: member declares {size} bytes")
            pos, buf = w.pos, w.buf
            end = pos + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))
        w.pos = end if end <= len(buf) else len(buf)
        if typeflag in _REGULAR:
            if long_name is None:
                nul = buf.find(b"\0", pos, pos + 100)
                member = buf[pos : nul if nul >= 0 else pos + 100]
                if buf[pos + 345] != 0 and buf[pos + 257 : pos + 262] == b"ustar":
                    member = buf[pos + 345 : pos + 500].split(b"\0", 1)[0] + b"/" + member
                raw = buf[pos:end]
                if len(raw) < end - pos:  # last member of a stream without end blocks or padding
                    raw += bytes(end - pos - len(raw))
            else:
                member, long_name = long_name, None
                data = buf[pos + BLOCK : pos + BLOCK + size]
                raw = member_header(member, size) + data + bytes(-size % BLOCK)
            yield member, raw, size, w.base + pos
        elif typeflag == 0x78:  # 'x': PAX header of the next member
            long_name = _parse_pax(buf[pos + BLOCK : pos + BLOCK + size]).get(b"path", long_name)
        elif typeflag == 0x4C:  # 'L': GNU long name of the next member
            long_name = buf[pos + BLOCK : pos + BLOCK + size].split(b"\0", 1)[0]
        else:
            long_name = None  # directories, links, global PAX headers: not sample members


def member_data(raw: bytes, size: int) -> bytes:
    """The data of a member from its raw encoding (the header is always one block)."""
    start = len(raw) - ((size + BLOCK - 1) & ~(BLOCK - 1))
    return raw[start : start + size]


def iter_samples(f: Readable, name: str) -> Iterator[Sample]:
    """Group members into samples as webdataset does; error on members that belong to no sample
    or repeat a field of their sample."""
    key: bytes | None = None
    members: list[SampleMember] = []
    exts: set[bytes] = set()
    for member, raw, size, offset in iter_members(f, name):
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
        ext = member[dot + 1 :]
        if k != key:
            if key is not None:
                yield key, members
            check_key(k, name)
            key, members, exts = k, [], {ext}
        elif ext in exts:
            raise DataError(
                f"{name}: duplicate sample key {k.decode(errors='replace')!r}: field {ext.decode(errors='replace')!r} appears twice"
            )
        else:
            exts.add(ext)
        members.append((member, raw, size))
    if key is not None:
        yield key, members


def sample_fields(members: list[SampleMember]) -> dict[str, bytes]:
    """A sample's fields by extension, as webdataset names them (``{"jpg": b"..."}``)."""
    out = {}
    for member, raw, size in members:
        slash = member.rfind(b"/") + 1
        ext = member[member.find(b".", slash) + 1 :]
        out[ext.decode("utf-8", "replace")] = member_data(raw, size)
    return out


def check_key(key: bytes, name: str) -> None:
    if _CONTROL.search(key):
        raise DataError(f"{name}: sample key {key!r} contains a control character; keys must be printable")
    try:
        key.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{name}: sample key {key!r} is not UTF-8") from None


def _template() -> tuple[bytearray, int]:
    h = bytearray(BLOCK)
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[135] = 0  # size digits go in 124:135, NUL terminator at 135
    h[136:148] = b"00000000000\0"
    h[148:156] = _SPACES
    h[156:157] = b"0"
    h[257:265] = b"ustar\x0000"
    return h, sum(h)


_TEMPLATE, _TEMPLATE_SUM = _template()


def member_header(name: bytes, size: int, typeflag: bytes = b"0") -> bytes:
    """A ustar header; names over 100 bytes use the prefix field or a PAX record."""
    prefix = b""
    if len(name) > 100:
        cut = name.rfind(b"/", 0, 156)
        if cut > 0 and len(name) - cut - 1 <= 100:
            prefix, name = name[:cut], name[cut + 1 :]
        else:
            record = b" path=" + name + b"\n"
            n = len(record) + 1
            while len(str(n)) + len(record) != n:
                n = len(str(n)) + len(record)
            pax = str(n).encode() + record
            return member_header(b"././@PaxHeader", len(pax), b"x") + _pad(pax) + member_header(name[-100:].lstrip(b"/"), size, typeflag)
    h = bytearray(_TEMPLATE)
    h[0 : len(name)] = name
    digits = b"%011o" % size
    h[124:135] = digits
    extra = sum(name) + sum(digits)
    if typeflag != b"0":
        h[156:157] = typeflag
        extra += typeflag[0] - 48
    if prefix:
        h[345 : 345 + len(prefix)] = prefix
        extra += sum(prefix)
    h[148:155] = b"%06o\0" % (_TEMPLATE_SUM + extra)
    return bytes(h)


def _pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


class TarWriter:
    """Writes samples as compact ustar members; ``close`` adds the end-of-archive blocks."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def write_member(self, name: bytes, data: bytes) -> int:
        header = member_header(name, len(data))
        pad = -len(data) % BLOCK
        self.f.write(header)
        self.f.write(data)
        if pad:
            self.f.write(_ZERO[:pad])
        return len(header) + len(data) + pad

    def write_sample(self, members: list[Member]) -> int:
        return sum(self.write_member(n, d) for n, d in members)

    def write_raw(self, members: list[SampleMember]) -> int:
        """Copy members as read by :func:`iter_samples` (already compact) without re-encoding."""
        n = 0
        for _, raw, _ in members:
            self.f.write(raw)
            n += len(raw)
        return n

    def close(self) -> int:
        self.f.write(_ZERO * 2)
        return 2 * BLOCK
