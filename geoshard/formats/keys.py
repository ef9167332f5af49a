"""The one check every format's sample keys pass: printable UTF-8."""

from __future__ import annotations

import re

from geoshard.errors import DataError

_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")


def check_key(key: bytes, name: str) -> None:
    if _CONTROL.search(key):
        raise DataError(f"{name}: sample key {key!r} contains a control character; keys must be printable")
    try:
        key.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{name}: sample key {key!r} is not UTF-8") from None
