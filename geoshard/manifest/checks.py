"""Bounds on what a manifest may claim, checked before anything is allocated or served from it.

A manifest arrives from a bucket, a replica or a user's folder, so every number in it is a claim:
an ``Infinity``, a negative count, a float or a count no shard could hold would otherwise reach
``int()``, numpy allocations or the loader's indexing as a traceback or a silent loss.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from geoshard.errors import DataError
from geoshard.formats import format_spec

MAX_MANIFEST_BYTES = 1024**3  # far above any real split's manifest; bounds what parsing may allocate
MAX_COUNT = 2**53 - 1  # the largest integer every JSON reader holds exactly


def parse(data: bytes, name: str) -> Any:
    """JSON from ``data``, refusing a file too large or nested too deeply to be a manifest."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise DataError(f"{name}: {len(data):,} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES:,})")
    try:
        return json.loads(data)
    except RecursionError:
        raise DataError(f"{name}: not a geoshard manifest (nested deeper than Python's JSON parser allows)") from None
    except ValueError as e:
        raise DataError(f"{name}: unreadable manifest: {e}") from e


def count(value: Any, field: str, name: str, upper: int = MAX_COUNT) -> int:
    """``value`` as a count: an integer from 0 to ``upper`` (no bool, float, Infinity or NaN)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        shown = value if not isinstance(value, float) or math.isfinite(value) else str(value)
        raise DataError(f"{name}: {field} must be an integer from 0 to {upper:,}, got {shown!r}")
    return value


def samples_fit(samples: int, size: int, fmt: str, field: str, name: str) -> None:
    """A shard of ``size`` bytes cannot hold more samples than its format's smallest sample allows."""
    most = size // format_spec(fmt, name).min_sample_bytes
    if samples > most:
        raise DataError(f"{name}: {field}: {samples:,} samples cannot fit in {size:,} bytes of {fmt} (at most {most:,})")


def mapping(value: Any, field: str, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{name}: {field} must be an object, got {type(value).__name__}")
    return value


def listing(value: Any, field: str, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise DataError(f"{name}: {field} must be a list, got {type(value).__name__}")
    return value


def is_hex(text: str) -> bool:
    """Whether ``text`` is lowercase hex digits only: a column of 10^5 digests checked at memory
    speed, a piece at a time so the check holds no second copy of it."""
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        return False
    a = np.frombuffer(raw, dtype=np.uint8)
    return all(bool(_HEX_BYTE[a[i : i + _PIECE]].all()) for i in range(0, len(a), _PIECE))


_HEX_BYTE = np.zeros(256, dtype=bool)
_HEX_BYTE[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = True
_PIECE = 1 << 20
