"""What a format is: one frozen :class:`FormatSpec` per format, the only thing other modules ask.

Each format folder (``wds/``, ``tfrecord/``) builds its spec from its own reader, writer and
indexer; :mod:`geoshard.formats.registry` looks them up by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from geoshard.formats._window import Readable

if TYPE_CHECKING:
    from geoshard.plan.routing import RouteSpec

OnUnterminated = Callable[[int], None]  # called with the offset where a stream without its end marker stops
# A batch of samples as the split moves them: (the samples' own keys, or None when they carry
# none; each sample's bytes as written to a shard; what keys and field values are read from,
# when that is not the written bytes). The written bytes may be views valid until the next batch.
SampleBatch = tuple[list[bytes] | None, list[Any], list[bytes] | None]
# A sample's routing field: (its value or None, the sample as an error names it).
FieldValue = Callable[[Any, Any, bytes | None, int], tuple[str | None, str]]


@dataclass(frozen=True)
class ShardIndex:
    """Where each sample of a fetched shard lies in ``buf`` (the shard, or its fields copied out)."""

    buf: Any
    keys: list[str] = field(default_factory=list)
    columns: list[tuple[str, list[int], list[int]]] | None = None  # (field, starts, ends): uniform tars
    fields: list[list[tuple[str, int, int]]] = field(default_factory=list)  # per sample: other tars
    spans: list[tuple[int, int]] = field(default_factory=list)  # per record: records without fields


@dataclass(frozen=True)
class SynthSample:
    """One sample of a synthetic corpus, before a format lays it out."""

    key: str
    image: bytes
    label: int
    origin: str


@dataclass(frozen=True)
class SplitHooks:
    """How the split reads a source of this format."""

    batches: Callable[[Readable, str, int | None, OnUnterminated | None], Iterator[SampleBatch]]
    keyed_by_feature: bool  # samples carry no key of their own: routing.key names the feature that holds it
    feature_keys: Callable[[list[bytes], str, str, int], list[bytes]] | None  # (bodies, feature, source, first index)
    field_value: Callable[[RouteSpec, str], FieldValue]  # the routing field's reader for one source


@dataclass(frozen=True)
class LoadHooks:
    """How the loaders read a fetched shard of this format."""

    index: Callable[[Any, str], ShardIndex]  # its sample positions (its bytes were verified)
    decoders: Mapping[str, Callable[[Any], Any]]  # decode= names this format's samples accept


@dataclass(frozen=True)
class FormatSpec:
    name: str
    suffix: str  # of the shards the split writes
    extensions: tuple[str, ...]  # source file names of this format (before an optional .gz)
    detect: Callable[[bytes], bool]  # whether a file's first 512 bytes are of this format
    trailer: bytes  # what ends a shard: a piece cut from one gets it to parse alone
    min_sample_bytes: int  # the smallest a sample can be: bounds a manifest's sample count by its bytes
    samples: Callable[[Readable, str], Iterator[Any]]  # a shard file's samples, streamed (counted by verify)
    field_names: Callable[[bytes], list[str]]  # one sample's fields as routing.field names them (for errors)
    named_fields: bool  # samples are dicts of named byte fields (webdataset decoders, TensorSpec, the built-in model)
    split: SplitHooks
    load: LoadHooks
    write_synthetic: Callable[[BinaryIO, Iterable[SynthSample]], None]


__all__ = ["FieldValue", "FormatSpec", "LoadHooks", "OnUnterminated", "SampleBatch", "ShardIndex", "SplitHooks", "SynthSample"]
