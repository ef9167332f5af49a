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
from geoshard.formats._window import Window

EXTENSIONS = (".tar",)
BLOCK = 512
_ZERO = bytes(BLOCK)
_SPACES = b" " * 8
# webdataset's base_plus_ext: key = everything up to the first dot of the basename.
_BASE_PLUS_EXT = re.compile(rb"^((?:.*/|)[^./]+)\.([^/]*)$")
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")

Member = tuple[bytes, bytes]  # (full member name, data)
Sample = tuple[bytes, list[Member]]  # (key, members in tar order)


def split_name(name: bytes) -> tuple[bytes, bytes] | None:
    m = _BASE_PLUS_EXT.match(name)
    return (m.group(1), m.group(2)) if m else None


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


def iter_members(f: BinaryIO, name: str) -> Iterator[tuple[bytes, bytes, int]]:
    """Yield ``(member name, data, header offset)`` for each regular file in the tar stream."""
    w = Window(f)
    long_name: bytes | None = None
    first = True
    while True:
        if not w.fill(BLOCK):
            if w.remaining():
                raise DataError(f"{name}: truncated tar at byte {w.offset}: partial header")
            if first:
                raise DataError(f"{name}: empty file; not a tar archive")
            return  # end of stream without end-of-archive blocks, as tarfile accepts
        pos, buf = w.pos, w.buf
        header = buf[pos : pos + BLOCK]
        offset = w.offset
        if header == _ZERO:
            if first:
                raise DataError(f"{name}: starts with an empty block; not a tar archive")
            return
        # Header checksum: the byte sum with the checksum field read as spaces. adler32's low half is
        # 1 + that sum mod 65521, which checks it at C speed.
        stored = header[148:156].strip(b"\0 ")
        try:
            chk = int(stored, 8)
        except ValueError:
            chk = -1
        if chk < 0 or (zlib.adler32(header[156:], zlib.adler32(_SPACES, zlib.adler32(header[:148]))) & 0xFFFF) != (chk + 1) % 65521:
            what = "not a tar archive" if first else "corrupted tar header"
            raise DataError(f"{name}: bad tar header checksum at byte {offset}; {what}")
        first = False
        size = _octal(header[124:136], "size", name, offset)
        typeflag = header[156:157]
        data_start = pos + BLOCK
        padded = (size + BLOCK - 1) & ~(BLOCK - 1)
        if not w.fill(BLOCK + padded):
            if w.remaining() < BLOCK + size:
                raise DataError(f"{name}: truncated tar at byte {offset}: member declares {size} bytes")
        pos, buf = w.pos, w.buf
        data_start = pos + BLOCK
        data = buf[data_start : data_start + size]
        w.pos = min(len(buf), data_start + padded)
        if typeflag in (b"0", b"\0", b"7"):
            if long_name is not None:
                member = long_name
                long_name = None
            else:
                member = header[:100].split(b"\0", 1)[0]
                if header[257:262] == b"ustar" and header[345] != 0:
                    member = header[345:500].split(b"\0", 1)[0] + b"/" + member
            yield member, data, offset
        elif typeflag == b"x":
            long_name = _parse_pax(data).get(b"path", long_name)
        elif typeflag == b"L":
            long_name = data.split(b"\0", 1)[0]
        else:
            long_name = None  # directories, links, global PAX headers: not sample members


def iter_samples(f: BinaryIO, name: str) -> Iterator[Sample]:
    """Group members into samples; error on members that belong to no sample or repeat a field."""
    key: bytes | None = None
    members: list[Member] = []
    exts: set[bytes] = set()
    for member, data, offset in iter_members(f, name):
        parts = split_name(member)
        if parts is None:
            base = member.rsplit(b"/", 1)[-1]
            if base.startswith(b"__") and base.endswith(b"__"):
                continue  # webdataset skips metadata members such as __index__
            raise DataError(
                f"{name}: tar member {member.decode(errors='replace')!r} at byte {offset} belongs to no sample "
                "(its basename has no '.ext' after the key)"
            )
        k, ext = parts
        if k != key:
            if key is not None:
                yield key, members
            check_key(k, name)
            key, members, exts = k, [], set()
        elif ext in exts:
            raise DataError(
                f"{name}: duplicate sample key {k.decode(errors='replace')!r}: field {ext.decode(errors='replace')!r} appears twice"
            )
        exts.add(ext)
        members.append((member, data))
    if key is not None:
        yield key, members


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


def member_bytes(name: bytes, size: int) -> int:
    """On-disk size of a member: header(s) plus padded data."""
    extra = 0 if len(name) <= 100 else 2 * BLOCK  # upper bound for prefix/PAX forms
    return BLOCK + extra + ((size + BLOCK - 1) & ~(BLOCK - 1))


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

    def close(self) -> int:
        self.f.write(_ZERO * 2)
        return 2 * BLOCK
