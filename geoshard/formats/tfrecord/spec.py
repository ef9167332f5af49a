"""TFRecord as the registry sees it: framed records, keyed by a feature when routing.key names one."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, BinaryIO

from geoshard.errors import DataError
from geoshard.formats._window import Readable
from geoshard.formats.keys import check_key
from geoshard.formats.spec import FieldValue, FormatSpec, LoadHooks, OnUnterminated, SampleBatch, ShardIndex, SplitHooks, SynthSample
from geoshard.formats.tfrecord.example import ExampleError, encode_example, feature_key, parse_example, parse_example_arrays
from geoshard.formats.tfrecord.framing import EXTENSIONS, TFRecordWriter, iter_framed, iter_records

if TYPE_CHECKING:
    from geoshard.plan.routing import RouteSpec

_LEN = struct.Struct("<Q")
_BATCH = 1024  # records per batch, and at most _BATCH_BYTES of them: a batch holds its records twice
_BATCH_BYTES = 4 << 20


def _detect(head: bytes) -> bool:
    return False  # no magic number: told by the file name only


def _batches(stream: Readable, url: str, size: int | None, unterminated: OnUnterminated | None) -> Iterator[SampleBatch]:
    """Records with their CRCs checked: (None, the framed records, the records)."""
    framed: list[bytes] = []
    records: list[bytes] = []
    held = 0
    for record, raw in iter_framed(stream, url, size):
        framed.append(raw)
        records.append(record)
        held += len(raw)
        if len(framed) == _BATCH or held >= _BATCH_BYTES:
            yield None, framed, records
            framed, records, held = [], [], 0
    if framed:
        yield None, framed, records


def _feature_keys(records: list[bytes], feature: str, url: str, first: int) -> list[bytes]:
    keys = []
    for index, record in enumerate(records, first):
        key = feature_key(record, feature, url, index)
        check_key(key, f"{url}: record {index}")
        keys.append(key)
    return keys


def _field_value(route: RouteSpec, url: str) -> FieldValue:
    value = route.tfrecord_value(url)

    def read(raw: Any, record: Any, key: bytes | None, index: int) -> tuple[str | None, str]:
        return value(record, index), f"record {index}"

    return read


def _index(buf: Any, path: str) -> ShardIndex:
    """Each record's span, walked by the length fields (the CRCs re-prove nothing after the digest check)."""
    pos, n = 0, len(buf)
    spans = []
    unpack = _LEN.unpack_from
    while pos < n:
        if pos + 12 > n:
            raise DataError(f"{path}: truncated TFRecord at byte {pos}")
        (length,) = unpack(buf, pos)
        end = pos + 12 + length + 4
        if end > n:
            raise DataError(f"{path}: truncated TFRecord at byte {pos}: record declares {length} bytes")
        spans.append((pos + 12, pos + 12 + length))
        pos = end
    return ShardIndex(buf, spans=spans)


def _write_synthetic(f: BinaryIO, samples: Iterable[SynthSample]) -> None:
    """A ``tf.train.Example`` per sample with features ``key``, ``image``, ``label`` and ``origin``."""
    tw = TFRecordWriter(f)
    for s in samples:
        tw.write(encode_example({"key": s.key.encode(), "image": s.image, "label": s.label, "origin": s.origin.encode()}))


def _field_names(record: bytes) -> list[str]:
    """A record's feature names (none when it is not a tf.train.Example)."""
    try:
        return sorted(parse_example(record))
    except ExampleError:
        return []


SPEC = FormatSpec(
    name="tfrecord",
    suffix=".tfrecord",
    extensions=EXTENSIONS,
    load=LoadHooks(index=_index, decoders=MappingProxyType({"example": parse_example_arrays})),
    named_fields=False,
    detect=_detect,
    trailer=b"",
    min_sample_bytes=16,  # a record's framing: length, its CRC, the data's CRC
    samples=iter_records,
    field_names=_field_names,
    split=SplitHooks(batches=_batches, keyed_by_feature=True, feature_keys=_feature_keys, field_value=_field_value),
    write_synthetic=_write_synthetic,
)
