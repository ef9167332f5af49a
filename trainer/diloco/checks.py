"""What every value read from the outer store is checked against before use, with bounds derived
from the model: a round number in range, a pseudo-gradient of exactly the model's element count in
the job's dtype and finite, an outer state of the model's shape, dtype float32 and finite. A value
that fails is ``Refused`` (never a traceback, never an allocation of a size the store claims)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.codec import codec, non_finite

MAX_ROUND = 10**9
# torch.save's zip framing around the state's two tensors and its few small fields.
STATE_FRAMING_BYTES = 64 << 10


@dataclass(frozen=True)
class Bounds:
    """The sizes a value may have, from the model's element count and the pseudo-gradient's dtype."""

    numel: int
    compression: str

    @property
    def grad_bytes(self) -> int:
        return codec(self.compression).nbytes(self.numel)

    @property
    def state_bytes(self) -> int:
        """At most: parameters and momentum in fp32, and the framing."""
        return 2 * 4 * self.numel + STATE_FRAMING_BYTES


def parse_round(payload: bytes) -> int:
    """A round number as stored (``latest``, a roster entry's round)."""
    text = payload.decode("ascii", errors="replace")
    if not text.isdigit() or int(text) > MAX_ROUND:
        raise Refused("malformed", f"{text[:40]!r} is not a round number (0 to {MAX_ROUND})")
    return int(text)


def grad(payload: bytes, bounds: Bounds) -> torch.Tensor:
    """A published pseudo-gradient → flat fp32, once its size and values are checked."""
    # The codec refuses a payload of another size, and scales that are not finite (int8, fp8).
    return finite(codec(bounds.compression).decode(payload, bounds.numel), "pseudo-gradient")


def finite(t: torch.Tensor, what: str) -> torch.Tensor:
    bad = non_finite(t)
    if bad:
        raise Refused("non-finite", f"{bad} of its {t.numel()} {what} values are NaN or infinite")
    return t


def state(obj: Any, bounds: Bounds, r: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A published outer state (``torch.load``-ed) → (parameters, momentum, step), checked against the
    model and the round it was published for."""
    if not isinstance(obj, dict) or set(obj) != {"round", "step", "params", "momentum"}:
        raise Refused("malformed", "not an outer state (round, step, params, momentum)")
    if obj["round"] != r or not isinstance(obj["step"], int) or obj["step"] < 0:
        raise Refused("malformed", f"round {obj['round']!r} step {obj['step']!r}, expected round {r} and a step >= 0")
    params = _tensor(obj["params"], bounds, "parameters")
    momentum = None if obj["momentum"] is None else _tensor(obj["momentum"], bounds, "momentum")
    return params, momentum, obj["step"]


def _tensor(t: Any, bounds: Bounds, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (bounds.numel,):
        shape = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise Refused("malformed", f"its {what} are {shape}, the model's are torch.float32 ({bounds.numel},)")
    return finite(t, what)
