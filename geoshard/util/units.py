"""Byte sizes and durations as users write them in plans and options ("64MB", "512KiB", 1048576;
"80ms", "1.5s", 0.08)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: object) -> int:
    """Return a byte count; raise ValueError with the accepted forms when ``value`` is not one."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 64MB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).upper() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ValueError(f"expected a size like 64MB, 512KiB or a byte count, got {value!r}")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|)\s*$")


def parse_duration(value: object) -> float:
    """Seconds from ``80ms``, ``1.5s`` or a plain number of seconds; ValueError naming the forms."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    if isinstance(value, str) and (m := _DURATION.match(value)):
        return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    raise ValueError(f"expected a duration like 80ms, 1.5s or a number of seconds, got {value!r}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
