"""Shard formats: one module per format, and how a file's format is recognised."""

from __future__ import annotations

from typing import Literal

from geoshard.formats import tfrecord, wds

Format = Literal["wds", "tfrecord"]
FORMATS: tuple[str, ...] = ("wds", "tfrecord")
SHARD_SUFFIX = {"wds": ".tar", "tfrecord": ".tfrecord"}


def format_of_name(name: str) -> Format | None:
    """Format implied by a file name (``.tar``, ``.tfrecord``, ``.tfrecord.gz``...), else None."""
    base = name.rsplit("/", 1)[-1].lower()
    if base.endswith(".gz"):
        base = base[:-3]
    if base.endswith(wds.EXTENSIONS):
        return "wds"
    if base.endswith(tfrecord.EXTENSIONS):
        return "tfrecord"
    return None


def is_gzip_name(name: str) -> bool:
    return name.lower().endswith(".gz")


__all__ = ["FORMATS", "SHARD_SUFFIX", "Format", "format_of_name", "is_gzip_name", "tfrecord", "wds"]
