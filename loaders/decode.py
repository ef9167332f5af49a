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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from geoshard.errors import ConfigError, DataError
from geoshard.formats.example import ExampleError, parse_example

DecodeSpec = str | Sequence[Any] | Callable[[Any], Any] | None


def parse_example_arrays(record: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, values in parse_example(record).items():
        if values and isinstance(values[0], bytes):
            out[name] = values
        elif values and isinstance(values[0], float):
            out[name] = np.asarray(values, dtype=np.float32)
        else:
            out[name] = np.asarray(values, dtype=np.int64)
    return out


def make_decoder(spec: DecodeSpec, fmt: str) -> Callable[[Any], Any] | None:
    if spec is None:
        return None
    if spec == "example":
        if fmt != "tfrecord":
            raise ConfigError(f"decode='example' parses TFRecord records; this region's shards are {fmt}")
        return parse_example_arrays
    if callable(spec):
        return spec
    if fmt != "wds":
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
