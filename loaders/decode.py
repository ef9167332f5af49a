"""Sample decoding and batch collation.

Raw samples are WebDataset dicts (``__key__`` and each field as bytes) or TFRecord record bytes.
``decode`` turns them into what the model wants:

- None: raw.
- ``"example"``: a TFRecord record parsed as ``tf.train.Example`` into numpy arrays, without
  TensorFlow (bytes lists stay lists of bytes).
- a webdataset image spec (``"rgb8"``, ``"torchrgb"``, ``"pil"`` ...) or a list of webdataset
  decoder handlers: webdataset's ``autodecode.Decoder`` over the dict (webdataset is imported
  only then: its import costs most of a second).
- any callable taking the raw sample.
- a ``TensorSpec``: fixed-size fields and labels straight into a batch's contiguous arrays, in the
  DataLoader workers (see ``fill_batch``), handed to the training process through shared memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from geoshard.errors import ConfigError, DataError
from geoshard.formats import format_spec
from geoshard.formats.example import ExampleError

DecodeSpec = Union[str, Sequence[Any], Callable[[Any], Any], "TensorSpec", None]


def make_decoder(spec: DecodeSpec, fmt: str) -> Callable[[Any], Any] | None:
    """A per-sample decoder; None for raw samples and for a ``TensorSpec`` (it decodes whole batches)."""
    if spec is None or isinstance(spec, TensorSpec):
        return None
    fs = format_spec(fmt)
    if spec == "example":
        decoder = fs.load.decoders.get("example")
        if decoder is None:
            raise ConfigError(f"decode='example' parses TFRecord records; this region's shards are {fmt}")
        return decoder
    if callable(spec):
        return spec
    if not fs.named_fields:
        raise ConfigError(f"decode={spec!r}: webdataset decoders apply to WebDataset samples; this region's shards are {fmt}")
    from webdataset import autodecode

    handlers = [autodecode.imagehandler(spec)] if isinstance(spec, str) else list(spec)
    return autodecode.Decoder(handlers)  # type: ignore[no-any-return]


def apply(decoder: Callable[[Any], Any], sample: Any, shard: str) -> Any:
    try:
        return decoder(sample)
    except ExampleError as e:
        raise DataError(f"{shard}: record is not a tf.train.Example: {e}") from None


def collate(samples: list[Any]) -> Any:
    """A batch: dicts become dicts of lists (bytes, str) or stacked tensors (arrays, numbers)."""
    first = samples[0]
    if isinstance(first, dict):
        return {k: collate([s[k] for s in samples]) for k in first}
    if isinstance(first, bytes | str):
        return samples
    import torch
    from torch.utils.data import default_collate

    if isinstance(first, np.ndarray | torch.Tensor | int | float):
        return default_collate(samples)
    return samples


# -- tensor batches ----------------------------------------------------------------------------
_ALIGN = 64  # each field's array starts on a cache line


@dataclass(frozen=True)
class Raw:
    """A fixed-size field's bytes as an array of ``shape`` per sample (``dtype`` elements)."""

    shape: tuple[int, ...]
    dtype: str = "uint8"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Label:
    """A field holding an ASCII integer (webdataset's ``.cls``): one int64 per sample."""

    nbytes: int = 8


@dataclass(frozen=True)
class TensorSpec:
    """``decode=TensorSpec({"img": Raw((100_000,)), "cls": Label()})``: each batch becomes a dict of
    tensors (``img``: uint8 of shape (batch, 100000), ``cls``: int64 of shape (batch,)) plus
    ``__key__`` (the sample keys), decoded in the DataLoader workers straight into one contiguous
    buffer per batch, which reaches the training process through shared memory (``slots.py``)."""

    fields: Mapping[str, Raw | Label]
    keys: bool = True

    def __post_init__(self) -> None:
        if not self.fields:
            raise ConfigError("TensorSpec needs at least one field")
        for name, kind in self.fields.items():
            if not isinstance(kind, Raw | Label):
                raise ConfigError(f"TensorSpec field {name!r}: expected Raw(shape, dtype) or Label(), got {kind!r}")
            if isinstance(kind, Raw):
                if not kind.shape or any(not isinstance(d, int) or d < 1 for d in kind.shape):
                    raise ConfigError(f"TensorSpec field {name!r}: shape must be positive integers, got {kind.shape!r}")
                try:
                    np.dtype(kind.dtype)
                except TypeError:
                    raise ConfigError(f"TensorSpec field {name!r}: unknown dtype {kind.dtype!r}") from None

    def layout(self, n: int) -> tuple[list[tuple[str, str, tuple[int, ...], int]], int]:
        """(field, dtype, shape, byte offset) of each array of an ``n``-sample batch, and the total bytes."""
        out, off = [], 0
        for name, kind in self.fields.items():
            if isinstance(kind, Raw):
                out.append((name, kind.dtype, (n, *kind.shape), off))
            else:
                out.append((name, "int64", (n,), off))
            off += -(-kind.nbytes * n // _ALIGN) * _ALIGN
        return out, off

    def batch_bytes(self, n: int) -> int:
        return self.layout(n)[1]


@dataclass(frozen=True)
class PackedBatch:
    """A decoded batch as it leaves a worker: where its bytes are (a shared slot, or ``data``)."""

    fields: list[tuple[str, str, tuple[int, ...], int]]
    nbytes: int
    keys: list[str] | None
    slot: int = -1  # a slot of the loader's shared pool, or -1: the bytes travel in ``data``
    data: np.ndarray | None = None


def fill_batch(spec: TensorSpec, samples: Sequence[Mapping[str, Any]], shards: Sequence[str], out: Any) -> PackedBatch:
    """Decode ``samples`` (fields as bytes or memoryviews) into ``out`` (a writable buffer of at least
    ``spec.batch_bytes(len(samples))`` bytes): one copy of each field's bytes, no Python object per
    field. Errors name the shard, the sample's key and the field."""
    n = len(samples)
    fields, total = spec.layout(n)
    mv = memoryview(out).cast("B")
    for (name, _dtype, _shape, off), kind in zip(fields, spec.fields.values(), strict=True):
        i = 0
        try:
            if isinstance(kind, Raw):
                k = kind.nbytes
                at = off
                for i, s in enumerate(samples):  # noqa: B007 - i names the sample in an error
                    v = s[name]
                    if len(v) != k:
                        raise DataError(f"{len(v)} bytes, the TensorSpec wants {k} ({kind.dtype} {kind.shape})")
                    mv[at : at + k] = v
                    at += k
            else:
                values = []
                for i, s in enumerate(samples):  # noqa: B007 - i names the sample in an error
                    values.append(int(bytes(s[name])))
                np.frombuffer(mv, dtype=np.int64, count=n, offset=off)[:] = values
        except KeyError:
            raise DataError(f"{shards[i]}: sample {_key(samples[i])} has no field {name!r} (TensorSpec)") from None
        except (ValueError, OverflowError, DataError) as e:
            raise DataError(f"{shards[i]}: sample {_key(samples[i])}, field {name!r}: {e}") from None
    keys = [s["__key__"] for s in samples] if spec.keys else None
    return PackedBatch(fields, total, keys)


def _key(sample: Any) -> str:
    return repr(sample.get("__key__", "?")) if isinstance(sample, Mapping) else "?"


def unpack(batch: PackedBatch, base: Any) -> dict[str, Any]:
    """The batch's tensors: views of ``base`` (its slot, or its own array), no copy."""
    import torch

    out: dict[str, Any] = {}
    for name, dtype, shape, off in batch.fields:
        count = math.prod(shape)
        arr = base[off : off + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
        out[name] = torch.from_numpy(arr)
    if batch.keys is not None:
        out["__key__"] = batch.keys
    return out


def tensor_spec(spec: DecodeSpec, fmt: str, batch_size: int | None) -> TensorSpec | None:
    """``spec`` if it is a ``TensorSpec`` usable here (WebDataset shards, batches), else None."""
    if not isinstance(spec, TensorSpec):
        return None
    if not format_spec(fmt).named_fields:
        raise ConfigError(f"decode=TensorSpec(...) reads WebDataset fields; this region's shards are {fmt}")
    if batch_size is None:
        raise ConfigError("decode=TensorSpec(...) makes batches: pass batch_size")
    return spec


def pack(spec: TensorSpec, samples: Sequence[Mapping[str, Any]], shards: Sequence[str], pool: Any, tag: int, packed: bool) -> Any:
    """One batch: into a free slot of ``pool`` (a ``SlotPool`` shared with the training process) if
    there is one, else into its own array. ``packed``: a ``PackedBatch`` for ``RegionalLoader`` to
    unpack, else the dict of tensors itself."""
    nbytes = spec.batch_bytes(len(samples))
    slot = pool.acquire(tag, nbytes) if pool is not None else -1
    if slot >= 0:
        return dataclasses.replace(fill_batch(spec, samples, shards, pool.buffer(slot, nbytes)), slot=slot)
    buf = np.empty(nbytes, dtype=np.uint8)
    batch = fill_batch(spec, samples, shards, buf)
    return dataclasses.replace(batch, data=buf) if packed else unpack(batch, buf)
