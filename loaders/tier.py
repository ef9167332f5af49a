"""The storage-tier protocol: a few primitives every tier implements, and an explicit registry.

A tier serves shards by their manifest path. ``stat`` gives the size (None when absent), ``read``
the whole object, ``read_range`` a slice, and ``view`` the whole object without a copy where the
tier can (a memory-mapped local file). ``writable`` says whether the tier holds a replica the chain
writes back to; such tiers add ``write`` and ``remove``. ``remove_corrupt`` drops a copy that
failed verification (a no-op on a tier that cannot remove). ``TierDefaults`` gives a new tier all
but ``stat`` and ``read``, as fsspec's filesystems get the rest from a few primitives, so the chain
uses only this protocol and never asks which tier it has. Tiers raise :class:`TierMissing` for an absent object and :class:`TierError` for
anything else (down, timeout, refused), so the chain can tell "try the next tier" from "this tier
is unhealthy".
"""

from __future__ import annotations

import importlib
import mmap
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from geoshard.errors import StorageError

Progress = Callable[[int], None]  # called with the bytes of a read that arrived since the last call


class TierError(StorageError):
    """The tier failed (unreachable, timed out, refused): the chain cools it down."""


class TierMissing(TierError):
    """The tier is healthy but does not hold this object."""


@runtime_checkable
class Tier(Protocol):
    name: str  # "alluxio:eu-west-1", "local:eu-west-1", "s3:us-east-1" ...
    kind: str  # a key of the registry
    region: str  # whose copy this is: reading another region's counts as egress
    writable: bool  # a replica the chain writes back to (then also a WritableTier)

    def stat(self, path: str) -> int | None: ...

    def read(self, path: str) -> bytes: ...

    def view(self, path: str) -> bytes | mmap.mmap: ...

    def read_range(self, path: str, offset: int, length: int, progress: Progress | None = None) -> bytes | memoryview: ...

    def remove_corrupt(self, path: str) -> None: ...


@runtime_checkable
class WritableTier(Tier, Protocol):
    def write(self, path: str, data: bytes) -> None: ...

    def remove(self, path: str) -> None: ...


@runtime_checkable
class BucketTier(Tier, Protocol):
    """A bucket the loader also writes small objects to: its job's lease (loaders/generation.py)."""

    def put(self, path: str, data: bytes) -> None: ...


class TierDefaults:
    """What a read-only tier gets for free from its ``read``: subclass it and add ``stat``/``read``."""

    writable = False

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def view(self, path: str) -> bytes | mmap.mmap:
        """The whole object for the chain to verify and cut samples from (a mapping or bytes)."""
        return self.read(path)

    def read_range(self, path: str, offset: int, length: int, progress: Progress | None = None) -> bytes | memoryview:
        """``length`` bytes from ``offset``. Tiers that stream may call ``progress(n)`` as bytes
        arrive (the rank's fetch queue); this default reads the whole object and calls nothing."""
        return self.read(path)[offset : offset + length]

    def remove_corrupt(self, path: str) -> None:
        """A tier that holds no replica of its own has nothing to remove: the next tier serves."""


# kind -> (module, class name, what to install): imported on first use, so a training image
# without, say, the Alluxio client can still read its local replica and S3.
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "local": ("geoshard.loaders.local_tier", "LocalTier", ""),
    "s3": ("geoshard.loaders.s3_tier", "S3Tier", "boto3"),
    "alluxio": ("geoshard.loaders.alluxio_tier", "AlluxioTier", "alluxio==1.0.0"),
}
TIER_KINDS: Mapping[str, tuple[str, str, str]] = MappingProxyType(_REGISTRY)


def register_tier(kind: str, module: str, cls: str, install: str = "") -> None:
    """Add a tier kind (a class in an importable module) to the registry."""
    if kind in _REGISTRY:
        raise ValueError(f"tier kind {kind!r} is already registered")
    _REGISTRY[kind] = (module, cls, install)


def tier_class(kind: str) -> Callable[..., Tier]:
    try:
        module, cls, install = _REGISTRY[kind]
    except KeyError:
        raise StorageError(f"unknown tier kind {kind!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    try:
        factory: Callable[..., Tier] = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise StorageError(f"tier {kind!r} needs {install or module}: install it to use this tier ({e})") from e
    return factory


def make_tier(kind: str, **config: Any) -> Tier:
    return tier_class(kind)(**config)
