"""Just enough of ``tf.train.Example`` to read and write features without TensorFlow.

Wire format: Example{1: Features{1: map<string, Feature>}}; Feature is a oneof of
BytesList(1), FloatList(2), Int64List(3), each a repeated ``value = 1`` (numbers packed or not).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import numpy as np

from geoshard.errors import DataError

FeatureValue = Union[list[bytes], list[float], list[int]]


class ExampleError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ExampleError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ExampleError("varint too long")


def _fields(buf: bytes, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """Yield (field number, wire type, value start, value end or varint value)."""
    pos = start
    end = len(buf) if end is None else end
    while pos < end:
        tag, pos = _varint(buf, pos)
        num, wt = tag >> 3, tag & 7
        if wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise ExampleError("length-delimited field overruns its message")
            yield num, wt, pos, pos + n
            pos += n
        elif wt == 0:
            v, pos = _varint(buf, pos)
            yield num, wt, v, v
        elif wt == 5:
            yield num, wt, pos, pos + 4
            pos += 4
        elif wt == 1:
            yield num, wt, pos, pos + 8
            pos += 8
        else:
            raise ExampleError(f"unsupported wire type {wt}")
    if pos != end:
        raise ExampleError("message overruns its length")


def _decode_feature(buf: bytes, start: int, end: int) -> FeatureValue:
    for kind, wt, s, e in _fields(buf, start, end):
        if wt != 2:
            raise ExampleError("feature kind is not a list message")
        if kind == 1:
            return [bytes(buf[vs:ve]) for num, vwt, vs, ve in _fields(buf, s, e) if num == 1 and vwt == 2]
        if kind == 2:
            floats: list[float] = []
            for _, vwt, vs, ve in _fields(buf, s, e):
                if vwt == 2:
                    floats.extend(struct.unpack(f"<{(ve - vs) // 4}f", buf[vs:ve]))
                elif vwt == 5:
                    floats.append(struct.unpack("<f", buf[vs:ve])[0])
            return floats
        if kind == 3:
            ints: list[int] = []
            for _, vwt, vs, ve in _fields(buf, s, e):
                if vwt == 2:
                    p = vs
                    while p < ve:
                        v, p = _varint(buf, p)
                        ints.append(v - (1 << 64) if v >> 63 else v)
                elif vwt == 0:
                    ints.append(vs - (1 << 64) if vs >> 63 else vs)
            return ints
    return []


def _iter_features(record: bytes) -> Iterator[tuple[str, int, int]]:
    for num, wt, s, e in _fields(record):
        if num != 1 or wt != 2:
            continue
        for fnum, fwt, fs, fe in _fields(record, s, e):
            if fnum != 1 or fwt != 2:
                continue
            name = None
            vs = ve = -1
            for enum, ewt, es, ee in _fields(record, fs, fe):
                if enum == 1 and ewt == 2:
                    name = bytes(record[es:ee]).decode("utf-8")
                elif enum == 2 and ewt == 2:
                    vs, ve = es, ee
            if name is not None:
                yield name, vs, ve


def parse_example(record: bytes) -> dict[str, FeatureValue]:
    """Decode every feature. Raises ExampleError on bytes that are not an Example."""
    try:
        return {name: (_decode_feature(record, vs, ve) if vs >= 0 else []) for name, vs, ve in _iter_features(record)}
    except UnicodeDecodeError as e:
        raise ExampleError("feature name is not UTF-8") from e


def get_feature(record: bytes, name: str) -> FeatureValue | None:
    """Decode only the feature ``name`` (routing reads one feature per record)."""
    try:
        for fname, vs, ve in _iter_features(record):
            if fname == name:
                return _decode_feature(record, vs, ve) if vs >= 0 else []
    except UnicodeDecodeError as e:
        raise ExampleError("feature name is not UTF-8") from e
    return None


def _enc_varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(num: int, payload: bytes) -> bytes:
    return _enc_varint(num << 3 | 2) + _enc_varint(len(payload)) + payload


Scalar = Union[bytes, str, int, float]


def encode_example(features: Mapping[str, Scalar | Sequence[Scalar]]) -> bytes:
    """Serialize a dict of features; scalars become one-element lists, str becomes UTF-8 bytes."""
    entries = []
    for name in sorted(features):
        raw = features[name]
        values: list[Scalar] = [raw] if isinstance(raw, (bytes, str, int, float)) else list(raw)
        texts = [v.encode() if isinstance(v, str) else v for v in values if isinstance(v, (bytes, str))]
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        nums = [float(v) for v in values if isinstance(v, (int, float))]
        if len(texts) == len(values):
            feature = _ld(1, b"".join(_ld(1, v) for v in texts))
        elif len(ints) == len(values):
            feature = _ld(3, _ld(1, b"".join(_enc_varint(v) for v in ints)))
        elif len(nums) == len(values):
            feature = _ld(2, _ld(1, struct.pack(f"<{len(nums)}f", *nums)))
        else:
            raise ExampleError(f"feature {name!r}: mixed or unsupported value types")
        entries.append(_ld(1, _ld(1, name.encode()) + _ld(2, feature)))
    return _ld(1, b"".join(entries))


def feature_key(record: bytes, keyname: str, source: str, index: int) -> bytes:
    """The sample key of a TFRecord record: its ``keyname`` feature as bytes."""
    try:
        v = get_feature(record, keyname)
    except ExampleError as e:
        raise DataError(f"{source}: record {index} is not a tf.train.Example ({e})") from e
    if not v:
        raise DataError(f"{source}: record {index} has no feature {keyname!r} (routing.key)")
    x = v[0]
    return x if isinstance(x, bytes) else str(x).encode()


def parse_example_arrays(record: bytes) -> dict[str, Any]:
    """``decode="example"``: the features as numpy arrays (bytes lists stay lists of bytes)."""
    out: dict[str, Any] = {}
    for name, values in parse_example(record).items():
        if values and isinstance(values[0], bytes):
            out[name] = values
        elif values and isinstance(values[0], float):
            out[name] = np.asarray(values, dtype=np.float32)
        else:
            out[name] = np.asarray(values, dtype=np.int64)
    return out
