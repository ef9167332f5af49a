"""TFRecord framing: uint64 length, masked CRC32C of the length, data, masked CRC32C of the data.

Both CRCs are checked on every read. The reader yields each record together with its framed
bytes so that the split can copy a verified record to its output without re-framing it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import BinaryIO

import google_crc32c

from geoshard.errors import DataError
from geoshard.formats._window import Readable, Window

_HEADER = struct.Struct("<QI")
_U32 = struct.Struct("<I")
_crc = google_crc32c.value
EXTENSIONS = (".tfrecord", ".tfrecords", ".tfrec")


def masked_crc(data: bytes) -> int:
    crc = _crc(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
    length = struct.pack("<Q", len(record))
    return b"".join((length, _U32.pack(masked_crc(length)), record, _U32.pack(masked_crc(record))))


def iter_framed(f: Readable, name: str, size: int | None = None) -> Iterator[tuple[bytes, bytes]]:
    """Yield ``(record, framed)`` for every record of ``f``; ``name`` labels errors; ``size``, the
    stream's length when known, refuses a declared length beyond the end before reading it."""
    w = Window(f, size=size)
    index = 0
    unpack_header = _HEADER.unpack_from
    unpack_u32 = _U32.unpack_from
    while True:
        pos = w.pos
        buf = w.buf
        if pos + 12 > len(buf):
            if not w.fill(12):
                if w.remaining():
                    raise DataError(f"{name}: truncated TFRecord at byte {w.offset}: record {index} has a partial header")
                return
            pos, buf = w.pos, w.buf
        length, length_crc = unpack_header(buf, pos)
        if masked_crc(buf[pos : pos + 8]) != length_crc:
            raise DataError(f"{name}: bad length CRC in record {index} at byte {w.offset}; not a TFRecord file or corrupted")
        end = pos + 12 + length + 4
        if end > len(buf):
            if not (w.fits(12 + length + 4) and w.fill(12 + length + 4)):
                raise DataError(
                    f"{name}: truncated TFRecord at byte {w.offset}: record {index} declares {length} bytes, "
                    f"{max(0, w.left() - 12)} present"
                )
            pos, buf = w.pos, w.buf
            end = pos + 12 + length + 4
        data = buf[pos + 12 : end - 4]
        if masked_crc(data) != unpack_u32(buf, end - 4)[0]:
            raise DataError(f"{name}: bad data CRC in record {index} at byte {w.offset}")
        yield data, buf[pos:end]
        w.pos = end
        index += 1


def iter_records(f: Readable, name: str, size: int | None = None) -> Iterator[bytes]:
    for data, _ in iter_framed(f, name, size):
        yield data


class TFRecordWriter:
    """Appends framed records to a binary stream."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def write(self, record: bytes) -> int:
        framed = frame(record)
        self.f.write(framed)
        return len(framed)
