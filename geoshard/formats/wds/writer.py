"""Writing WebDataset tar shards: compact ustar members (one header block, mtime 0, PAX only when
a name needs it), so readers pay little per member."""

from __future__ import annotations

from typing import BinaryIO

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
CHECKSUM_SPACES = b" " * 8  # the checksum field as it is summed
Member = tuple[bytes, bytes]  # (full member name, data)


def _template() -> tuple[bytearray, int]:
    h = bytearray(BLOCK)
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[135] = 0  # size digits go in 124:135, NUL terminator at 135
    h[136:148] = b"00000000000\0"
    h[148:156] = CHECKSUM_SPACES
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
            self.f.write(ZERO_BLOCK[:pad])
        return len(header) + len(data) + pad

    def write_sample(self, members: list[Member]) -> int:
        return sum(self.write_member(n, d) for n, d in members)

    def close(self) -> int:
        self.f.write(ZERO_BLOCK * 2)
        return 2 * BLOCK
