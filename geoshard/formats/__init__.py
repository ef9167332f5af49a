"""Shard formats: one folder per format (``wds/``, ``tfrecord/``) behind one registry.

Other modules ask :func:`format_spec` what a format does; ``wds``, ``tfrecord``, ``example`` and
``tarscan`` stay importable from here.
"""

from __future__ import annotations

from geoshard.formats import example, tarscan, tfrecord, wds
from geoshard.formats.registry import FORMATS, SHARD_SUFFIX, Format, detect_format, format_of_name, format_spec, is_gzip_name
from geoshard.formats.spec import FormatSpec, ShardIndex, SynthSample

__all__ = [
    "FORMATS",
    "SHARD_SUFFIX",
    "Format",
    "FormatSpec",
    "ShardIndex",
    "SynthSample",
    "detect_format",
    "example",
    "format_of_name",
    "format_spec",
    "is_gzip_name",
    "tarscan",
    "tfrecord",
    "wds",
]
