"""The demo model: an MLP that classifies the synthetic corpus's image bytes by their label.

Each synthetic image is a class-dependent rotation of one pattern plus a small random shift
(``geoshard.local.synth``), so the leading bytes identify the class and a small model learns it in a
few hundred steps on a CPU. ``collate`` runs in the DataLoader workers and returns numpy arrays:
small arrays cross to the training process pickled inline, cheaper than torch's shared-memory
hand-off of tensors (a file descriptor and an mmap per tensor); ``to_tensors`` finishes the job.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

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


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """WebDataset samples (``img``, ``cls``) → input bytes, labels and keys as numpy/lists."""
    x = np.zeros((len(samples), INPUT_BYTES), dtype=np.uint8)
    for i, s in enumerate(samples):
        img = s["img"][:INPUT_BYTES]
        x[i, : len(img)] = np.frombuffer(img, dtype=np.uint8)
    y = np.array([int(s["cls"]) for s in samples], dtype=np.int64)
    return {"x": x, "y": y, "keys": [s["__key__"] for s in samples]}


def count_collate(samples: list[Any]) -> dict[str, Any]:
    """``--model none``: any layout (WebDataset dicts, TFRecord records); only counted and keyed."""
    return {"n": len(samples), "keys": [s.get("__key__") if isinstance(s, dict) else None for s in samples]}


def to_tensors(batch: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs scaled to [0, 1] and labels, on ``device``."""
    x = torch.from_numpy(batch["x"]).to(device, non_blocking=True).float().div_(255.0)
    return x, torch.from_numpy(batch["y"]).to(device, non_blocking=True)
