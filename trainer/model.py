"""The built-in model: an MLP that classifies a fixed-size input made of the bytes of some fields.

By default it reads the synthetic corpus (``geoshard.local.synth``): ``img`` and ``cls``. Each
synthetic image is a class-dependent rotation of one pattern plus a small random shift, so the
leading bytes identify the class and a small model learns it in a few hundred steps on a CPU.
On your own corpus (``--input-field jpg --label-field cls``, or TFRecord feature names) it measures
the data path with real batches: each input field's bytes, of any length, are truncated or
zero-padded into its equal part of the input; the label is an integer (text digits, or a TFRecord
int64) taken modulo the class count.

``ModelInput`` runs in the DataLoader workers and returns numpy arrays: small arrays cross to the
training process pickled inline, cheaper than torch's shared-memory hand-off of tensors (a file
descriptor and an mmap per tensor); ``to_tensors`` finishes the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from geoshard.errors import DataError
from geoshard.formats.example import ExampleError, parse_example
from geoshard.local.synth import NUM_CLASSES

INPUT_BYTES = 256


class Net(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(INPUT_BYTES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ModelInput:
    """A batch's collate function for the model: ``inputs`` fields → input bytes, ``label`` → labels.
    Samples are WebDataset dicts of bytes, or TFRecord records (parsed here)."""

    inputs: tuple[str, ...] = ("img",)
    label: str = "cls"

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        x = np.zeros((len(samples), INPUT_BYTES), dtype=np.uint8)
        y = np.zeros(len(samples), dtype=np.int64)
        part = INPUT_BYTES // len(self.inputs)
        keys = []
        for i, sample in enumerate(samples):
            fields = sample if isinstance(sample, dict) else _features(sample)
            key = fields.get("__key__")
            for j, name in enumerate(self.inputs):
                raw = _field_bytes(_field(fields, name, key), part)
                x[i, j * part : j * part + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            y[i] = _label(_field(fields, self.label, key), self.label, key) % NUM_CLASSES
            keys.append(key)
        return {"x": x, "y": y, "keys": keys}


collate = ModelInput()  # the synthetic corpus's img and cls


def _features(record: Any) -> dict[str, Any]:
    try:
        return parse_example(bytes(record))
    except ExampleError as e:
        raise DataError(f"a record is not a tf.train.Example ({e}); the built-in model reads its features") from None


def _field(fields: dict[str, Any], name: str, key: Any) -> Any:
    if name not in fields:
        have = ", ".join(sorted(k for k in fields if not k.startswith("__")))
        sample = f"sample {key!r}" if key is not None else "a record"
        raise DataError(f"{sample} has no field {name!r} (it has {have}); name yours with --input-field and --label-field")
    return fields[name]


def _field_bytes(value: Any, limit: int) -> bytes:
    """Up to ``limit`` bytes of a field: its bytes, or a TFRecord feature's values."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value[:limit])
    if value and isinstance(value[0], bytes):
        return b"".join(value)[:limit]
    return np.asarray(value, dtype=np.float32 if value and isinstance(value[0], float) else np.int64).tobytes()[:limit]


def _label(value: Any, name: str, key: Any) -> int:
    """An integer label: a field's text digits, or a TFRecord int64 (or digits) feature's first value."""
    if isinstance(value, list):
        value = value[0] if value else b""
    if isinstance(value, int):
        return value
    try:
        return int(bytes(value))
    except (TypeError, ValueError):
        sample = f"sample {key!r}" if key is not None else "a record"
        raise DataError(f"{sample}: label field {name!r} is not an integer ({str(value)[:40]}); --label-field names one") from None


def count_collate(samples: list[Any]) -> dict[str, Any]:
    """``--model none``: any layout (WebDataset dicts, TFRecord records); only counted and keyed."""
    return {"n": len(samples), "keys": [s.get("__key__") if isinstance(s, dict) else None for s in samples]}


def to_tensors(batch: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs scaled to [0, 1] and labels, on ``device``."""
    x = torch.from_numpy(batch["x"]).to(device, non_blocking=True).float().div_(255.0)
    return x, torch.from_numpy(batch["y"]).to(device, non_blocking=True)
