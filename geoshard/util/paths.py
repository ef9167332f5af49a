"""What a manifest may name: the one check that a shard path stays inside its folder.

A manifest comes from a bucket or a folder someone else may write. Every reader that turns one of
its paths into a local file name (``pull``, the loader's local replica, ``verify``) goes through
:func:`check_shard_path` first, so a manifest can neither write nor delete outside the target,
nor make geoshard treat a user's file as one of its shards.
"""

from __future__ import annotations

import re

from geoshard.errors import ConfigError
from geoshard.formats import SHARD_SUFFIX

# What split writes: group, part, the first 12 hex digits of the sha256, the format's suffix.
SHARD_NAME = re.compile(r"[0-9]{5}-[0-9]{4}-[0-9a-f]{12}(?:" + "|".join(re.escape(s) for s in SHARD_SUFFIX.values()) + ")")


def is_shard_name(name: str) -> bool:
    """True for a file name of geoshard's content-addressed shard pattern (no folder part)."""
    return SHARD_NAME.fullmatch(name) is not None


def plain_relative(path: object, where: str) -> str:
    """``path`` when it is a plain relative file path: segments separated by ``/``, none of them
    empty, ``.`` or ``..``, no leading ``/``, no backslash or control character. Else a ConfigError
    naming ``where`` (the manifest) and the path."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: shard path {path!r} is not a file name")
    bad = (
        path.startswith("/")
        or "\\" in path
        or any(ord(c) < 32 or ord(c) == 127 for c in path)
        or any(seg in ("", ".", "..") for seg in path.split("/"))
    )
    if bad:
        raise ConfigError(f"{where}: shard path {path!r} is not a plain relative file name (no '.', '..', empty or absolute parts)")
    return path


def check_shard_path(path: object, where: str) -> str:
    """A manifest's shard path: plain, relative, and of the shard name pattern geoshard writes
    (``00003-0000-1a2b3c4d5e6f.tar``). Anything else is a ConfigError naming the manifest."""
    p = plain_relative(path, where)
    if not is_shard_name(p):
        raise ConfigError(
            f"{where}: {p!r} is not a shard name (NNNNN-NNNN-<12 hex digits>{' or '.join(SHARD_SUFFIX.values())}); refusing this manifest"
        )
    return p


__all__ = ["SHARD_NAME", "check_shard_path", "is_shard_name", "plain_relative"]
