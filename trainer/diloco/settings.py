"""What the regions of a DiLoCo job agree on: the outer settings, and the pseudo-gradient's form
on the long links."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geoshard.errors import ConfigError
from geoshard.trainer.diloco.codec import CODECS, codec

COMPRESSIONS = tuple(CODECS)  # the codecs (codec.py): fp16 bf16 none int8 fp8
# The codecs an all-reduce can sum on the wire (the p2p transport), as the dtype it sums in; int8
# and fp8 go over p2p as a reduce-scatter and all-gather in their own bytes (quantized.py).
SUMMABLE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": torch.float32}
TRANSPORTS = ("store", "p2p")
MAX_STREAMS = 64


@dataclass(frozen=True)
class OuterSync:
    outer_steps: int = 100  # H: inner steps between outer rounds
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: str = "fp16"  # of the pseudo-gradient on the long links: fp16 | bf16 | none | int8 | fp8
    error_feedback: bool = True  # carry what a lossy compression dropped into the next round (codec.ErrorFeedback)
    round_timeout_s: float = 60.0  # how long a leader waits for the expected regions
    join_timeout_s: float = 300.0  # how long a starting region waits for the first published state
    # Inner steps a round's exchange runs behind (0: the region waits for each round). With k > 0
    # the round starts at step nH, training goes on, and at step nH + k the region takes the new
    # outer parameters plus what it learnt in those k steps (Streaming DiLoCo's overlap, arXiv 2501.18512).
    overlap_steps: int = 0
    # How pseudo-gradients travel: "store" (each leader through the outer store) or "p2p" (gloo
    # between the regions' ranks, sharded over every rank; the store for membership only).
    transport: str = "store"
    streams: int = 8  # p2p: concurrent all-reduces (TCP streams) per pair of regions, split over the shards

    def __post_init__(self) -> None:
        if self.outer_steps < 1:
            raise ConfigError(f"outer_steps must be 1 or more, got {self.outer_steps}")
        if self.outer_lr <= 0:
            raise ConfigError(f"outer_lr must be above 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"outer compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.round_timeout_s <= 0 or self.join_timeout_s <= 0:
            raise ConfigError("round_timeout_s and join_timeout_s must be above 0")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"outer transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError(f"outer streams must be 1 to {MAX_STREAMS}, got {self.streams}")
        if not 0 <= self.overlap_steps < self.outer_steps:
            raise ConfigError(f"overlap_steps must be at least 0 and below outer_steps ({self.outer_steps}), got {self.overlap_steps}")


def encode(delta: torch.Tensor, compression: str) -> bytes:
    """A flat fp32 tensor → the bytes published (``codec(compression).encode``)."""
    return codec(compression).encode(delta)


def decode(payload: bytes, compression: str, numel: int | None = None) -> torch.Tensor:
    """The published bytes → a flat fp32 tensor on the CPU (``numel``: needed for int8 and fp8)."""
    c = codec(compression)
    if numel is None:
        if not c.summable:
            raise ConfigError(f"decode: {compression} payloads need the element count (numel)")
        numel = len(payload) // c.nbytes(1)
    return c.decode(payload, numel)
