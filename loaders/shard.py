"""A fetched shard in memory, indexed once so that any of its samples can be cut out by position.

WebDataset tars go through the vectorized tar scanner (one numpy pass over the headers, no
per-member Python); tars it declines (PAX headers, long names) are read member by member. TFRecord
frames are walked by their length fields: the shard's sha256 was checked against the manifest when
it was fetched, so the per-record CRCs would only re-prove it.
"""

from __future__ import annotations

import io
import struct
from typing import Any

from geoshard.errors import DataError
from geoshard.formats import wds
from geoshard.formats.tarscan import scan

_LEN = struct.Struct("<Q")
RawSample = dict[str, Any] | bytes


class Shard:
    """The samples of one shard: ``len(shard)`` and ``shard.sample(i)``."""

    __slots__ = ("_fields", "_keys", "_spans", "buf", "path")

    def __init__(self, path: str, buf: bytes, fmt: str) -> None:
        self.path = path
        self.buf = buf
        self._keys: list[str] = []
        self._fields: list[list[tuple[str, int, int]]] = []
        self._spans: list[tuple[int, int]] = []
        if fmt == "tfrecord":
            self._index_tfrecord()
        elif fmt == "wds":
            self._index_tar()
        else:
            raise DataError(f"{path}: unknown shard format {fmt!r}")

    def __len__(self) -> int:
        return len(self._spans) if self._spans else len(self._keys)

    def sample(self, i: int) -> RawSample:
        if self._spans:
            s, e = self._spans[i]
            return self.buf[s:e]
        buf = self.buf
        out: dict[str, Any] = {"__key__": self._keys[i]}
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

    def _index_tar(self) -> None:
        r = scan(self.buf, 0, eof=True, members=True)
        if r is None or r.members is None or not (r.end_of_archive or r.consumed == len(self.buf)):
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
