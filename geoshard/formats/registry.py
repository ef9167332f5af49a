"""The formats by name: every other module asks here, never compares format names itself.

As MosaicML streaming dispatches its readers (``streaming/base/format/__init__.py``): one folder
per format, each exporting its :class:`~geoshard.formats.spec.FormatSpec`, gathered in one
private table behind read-only views.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, cast

from geoshard.errors import DataError
from geoshard.formats.spec import FormatSpec
from geoshard.formats.tfrecord.spec import SPEC as _TFRECORD
from geoshard.formats.wds.spec import SPEC as _WDS

Format = Literal["wds", "tfrecord"]
_SPECS: dict[str, FormatSpec] = {s.name: s for s in (_WDS, _TFRECORD)}
FORMATS: tuple[str, ...] = tuple(_SPECS)
SHARD_SUFFIX: Mapping[str, str] = MappingProxyType({name: s.suffix for name, s in _SPECS.items()})


def format_spec(name: str, where: str = "format") -> FormatSpec:
    """The spec of format ``name``; a DataError naming ``where`` (a manifest, a shard) for an unknown one."""
    try:
        return _SPECS[name]
    except KeyError:
        raise DataError(f"{where}: unknown shard format {name!r}; geoshard reads {' or '.join(FORMATS)}") from None


def format_of_name(name: str) -> Format | None:
    """Format implied by a file name (``.tar``, ``.tfrecord``, ``.tfrecord.gz``...), else None."""
    base = name.rsplit("/", 1)[-1].lower()
    if base.endswith(".gz"):
        base = base[:-3]
    for spec in _SPECS.values():
        if base.endswith(spec.extensions):
            return cast(Format, spec.name)
    return None


def detect_format(head: bytes) -> Format | None:
    """Format told by a file's first 512 bytes, for formats that have a magic number; else None."""
    for spec in _SPECS.values():
        if spec.detect(head):
            return cast(Format, spec.name)
    return None


def is_gzip_name(name: str) -> bool:
    return name.lower().endswith(".gz")
