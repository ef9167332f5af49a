"""The pseudo-gradient's form on the long links: a codec turns a flat fp32 tensor into the bytes a
region sends and back, and ``ErrorFeedback`` carries what a lossy codec dropped into the next round.

- ``fp16``, ``bf16``, ``none`` (fp32): a cast, ``numel * itemsize`` bytes. Values in these forms
  can be summed by an all-reduce as they travel (``summable``).
- ``int8``: per block of ``BLOCK`` values, the block's absmax as fp32, then each value rounded to
  the nearest of -127..127 times absmax/127: error at most absmax/254 per value (plus fp32
  rounding, below absmax * 2**-22). ``numel + 4 * ceil(numel / BLOCK)`` bytes, about half fp16's.
- ``fp8``: the same blocks and scales, each value scaled to +-448 and cast to float8_e4m3fn
  (3 mantissa bits, round to nearest even): error at most |x|/16 + absmax * 2**-19 per value.
  The same size as int8.

int8 and fp8 values are not ``summable`` (each block has its own scale): a collective gathers
them and sums after decoding, as INTELLECT-1 does. ``decode`` checks what it reads before use:
the exact size, and scales finite and not negative; a value that fails is ``Refused``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from geoshard.errors import ConfigError, DataError
from geoshard.trainer.diloco.auth import Refused

log = logging.getLogger(__name__)

BLOCK = 1024  # values per scale: 4 bytes of scale per 1024 values (0.4% over int8's 1 byte a value)
_SCALE = torch.float32
CHUNK_BLOCKS = 4096  # blocks encoded or decoded per pass: 4M values, ~50 MB of temporaries


class NonFinite(DataError):
    """A pseudo-gradient to encode holds NaN or infinite values (the region's training diverged)."""


class Codec(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def summable(self) -> bool:
        """Whether an all-reduce may sum values in this form as they travel."""
        ...

    def nbytes(self, numel: int) -> int:
        """The exact size of ``numel`` values encoded: a reader bounds a value before reading it."""
        ...

    def encode(self, flat: torch.Tensor) -> bytes:
        """A flat fp32 tensor (any device) → bytes; ``NonFinite`` if it holds NaN or infinite values."""
        ...

    def roundtrip(self, flat: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """``encode(flat)`` and, without reading those bytes back, the fp32 CPU tensor ``decode``
        gives for them (the same values): error feedback's residual is what was sent minus it."""
        ...

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Bytes → a flat fp32 tensor on the CPU; ``Refused`` when they are not ``numel`` values of this form."""
        ...


def non_finite(t: torch.Tensor) -> int:
    """How many of ``t``'s values are NaN or infinite. One pass when none is: a NaN or an infinity
    makes the sum NaN or infinite, so only a sum that is not finite (or that overflowed) pays the
    exact count."""
    if math.isfinite(float(t.sum())):
        return 0
    return int((~torch.isfinite(t)).sum())


def _finite(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as a flat fp32 tensor on its own device; ``NonFinite`` if it holds NaN or infinite values."""
    x = flat.detach().reshape(-1).to(torch.float32)
    bad = non_finite(x)
    if bad:
        raise NonFinite(f"{bad} of the pseudo-gradient's {x.numel()} values are NaN or infinite: nothing to encode")
    return x


def _finite_cpu(flat: torch.Tensor) -> torch.Tensor:
    return _finite(flat).contiguous().cpu()


def _sized(payload: bytes, want: int, numel: int, name: str) -> None:
    if len(payload) != want:
        raise Refused("malformed", f"{len(payload)} bytes, the model's {numel} {name} values take {want}")


@dataclass(frozen=True)
class Cast:
    """fp16 / bf16 / fp32: the values cast, byte for byte what the store carried before codecs."""

    name: str
    dtype: torch.dtype
    summable: bool = True

    def nbytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize

    def encode(self, flat: torch.Tensor) -> bytes:
        # Cast where the values are, then copy: a GPU's copy to the host carries 2 bytes a value, not 4
        # (the copy was most of fp16's encode at 10^9 values on an H200 node). The cast rounds to
        # nearest even on either device, so the bytes are the same.
        return self._cast(flat).view(torch.uint8).numpy().tobytes()

    def roundtrip(self, flat: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        t = self._cast(flat)
        return t.view(torch.uint8).numpy().tobytes(), t.to(torch.float32)

    def _cast(self, flat: torch.Tensor) -> torch.Tensor:
        return _finite(flat).to(self.dtype).cpu()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        _sized(payload, self.nbytes(numel), numel, self.name)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).to(torch.float32)


@dataclass(frozen=True)
class Blockwise:
    """int8 / fp8: per block of ``block`` values its absmax (fp32), then one byte a value."""

    name: str
    dtype: torch.dtype  # torch.int8 | torch.float8_e4m3fn
    qmax: float  # the largest code: 127 | 448
    block: int = BLOCK
    summable: bool = False

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def nbytes(self, numel: int) -> int:
        return numel + _SCALE.itemsize * self.blocks(numel)

    def encode(self, flat: torch.Tensor) -> bytes:
        return self._encode(flat, None)

    def roundtrip(self, flat: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        back = torch.empty(flat.numel(), dtype=torch.float32)
        return self._encode(flat, back), back

    def _encode(self, flat: torch.Tensor, back: torch.Tensor | None) -> bytes:
        """The payload; with ``back``, also what ``decode`` makes of it, written there (the same
        operations on the same codes and scales, so the same floats; an int8 zero may be -0.0)."""
        x = _finite_cpu(flat)
        n = x.numel()
        scales = torch.empty(self.blocks(n), dtype=_SCALE)
        codes = torch.empty(n, dtype=torch.uint8)
        for lo, hi in self._chunks(n):
            b = lo // self.block
            tail = -(hi - lo) % self.block  # only the last chunk's last block is partial: pad that one alone
            xb = (torch.nn.functional.pad(x[lo:hi], (0, tail)) if tail else x[lo:hi]).view(-1, self.block)
            absmax = xb.abs().amax(dim=1)
            scales[b : b + absmax.numel()] = absmax
            # x / absmax lies in [-1, 1] (exact division, no overflow at 3e38 nor underflow at 1e-45).
            scaled = xb / torch.where(absmax > 0, absmax, 1.0)[:, None]
            scaled.mul_(self.qmax)
            if self.dtype == torch.int8:
                q = scaled.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
            else:
                q = scaled.clamp_(-self.qmax, self.qmax).to(self.dtype)
            codes[lo:hi] = q.reshape(-1)[: hi - lo].view(torch.uint8)
            if back is not None:
                # int8: ``scaled`` holds the codes' values already (whole numbers in fp32); fp8's
                # are what the cast rounded them to
                vals = scaled if self.dtype == torch.int8 else q.to(torch.float32)
                back[lo:hi] = vals.div_(self.qmax).mul_(absmax[:, None]).reshape(-1)[: hi - lo]
        return scales.numpy().tobytes() + codes.numpy().tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        _sized(payload, self.nbytes(numel), numel, self.name)
        nb = self.blocks(numel)
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        head = nb * _SCALE.itemsize
        scales = raw[:head].view(_SCALE)
        bad = non_finite(scales)
        if bad:
            raise Refused("non-finite", f"{bad} of its {nb} {self.name} block scales are NaN or infinite")
        if bool((scales < 0).any()):
            raise Refused("malformed", f"{int((scales < 0).sum())} of its {nb} {self.name} block scales are negative")
        codes = raw[head:].view(self.dtype)
        if self.dtype == torch.int8 and bool((codes == -128).any()):
            raise Refused("malformed", f"{int((codes == -128).sum())} of its int8 codes are -128 (never encoded)")
        out = torch.empty(numel, dtype=torch.float32)
        for lo, hi in self._chunks(numel):
            vals = torch.nn.functional.pad(codes[lo:hi].to(torch.float32), (0, -(hi - lo) % self.block)).view(-1, self.block)
            b = lo // self.block
            # code / qmax lies in [-1, 1], so the product never overflows a finite scale.
            out[lo:hi] = (vals / self.qmax * scales[b : b + vals.shape[0], None]).reshape(-1)[: hi - lo]
        # fp8's NaN codes; an int8 code (-127..127) over 127 times a finite scale is finite
        bad = non_finite(out) if self.dtype != torch.int8 else 0
        if bad:
            raise Refused("non-finite", f"{bad} of its {numel} {self.name} values are NaN")
        return out

    def _chunks(self, numel: int) -> list[tuple[int, int]]:
        """Slices of whole blocks, so the temporaries stay bounded (``CHUNK_BLOCKS``) whatever the model's size."""
        step = CHUNK_BLOCKS * self.block
        return [(lo, min(numel, lo + step)) for lo in range(0, numel, step)]


CODECS: dict[str, Codec] = {
    "fp16": Cast("fp16", torch.float16),
    "bf16": Cast("bf16", torch.bfloat16),
    "none": Cast("none", torch.float32),
    "int8": Blockwise("int8", torch.int8, 127.0),
    "fp8": Blockwise("fp8", torch.float8_e4m3fn, 448.0),
}


def codec(name: str) -> Codec:
    """The codec called ``name``; ConfigError naming the choices otherwise."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"outer compression must be one of {', '.join(CODECS)}, got {name!r}") from None


def unusable(c: Codec, numel: int) -> bytes:
    """A payload of the right size that every reader refuses as non-finite: what a region whose own
    pseudo-gradient is not finite publishes, so the others leave it out at once instead of waiting."""
    if isinstance(c, Blockwise):
        nan = torch.full((c.blocks(numel),), float("nan"), dtype=_SCALE)
        return bytes(nan.view(torch.uint8).numpy().tobytes()) + bytes(numel)
    assert isinstance(c, Cast)
    return bytes(torch.full((numel,), float("nan"), dtype=c.dtype).view(torch.uint8).numpy().tobytes())


class ErrorFeedback:
    """One per owner of a pseudo-gradient (a region leader): each round encodes the pseudo-gradient
    plus the residual the previous rounds' encodings dropped, and keeps the new residual
    (sent - decode(encode(sent))), so the sum of what was sent tracks the sum of the pseudo-gradients
    within one round's rounding error instead of drifting. ``enabled=False``, or a lossless codec:
    the codec alone (no residual held)."""

    def __init__(self, c: Codec, numel: int, enabled: bool = True) -> None:
        self.codec, self.numel = c, numel
        self.enabled = enabled and c.name != "none"
        self.residual: torch.Tensor | None = None  # allocated at the first round, on the delta's device

    def encode(self, delta: torch.Tensor) -> bytes:
        """The bytes to send for ``delta``; ``NonFinite`` (residual unchanged) if it is not finite."""
        if not self.enabled:
            return self.codec.encode(delta)
        sent = delta.detach().reshape(-1).float()
        if self.residual is not None:
            sent = sent + self.residual.to(sent.device)
        payload, back = self.codec.roundtrip(sent)
        self.residual = sent - back.to(sent.device)
        return payload

    def state_dict(self) -> dict[str, Any]:
        residual = None if self.residual is None else self.residual.detach().cpu().clone()
        return {"codec": self.codec.name, "residual": residual}

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's residual, checked (``Refused``: the residual stays as it was). One saved for
        another codec is dropped: its rounding errors are not this codec's."""
        if not isinstance(state, dict) or set(state) != {"codec", "residual"}:
            raise Refused("malformed", "the error feedback state is not {codec, residual}")
        residual = state["residual"]
        if state["codec"] != self.codec.name or not self.enabled or residual is None:
            self.residual = None
            return
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or tuple(residual.shape) != (self.numel,):
            shape = f"{residual.dtype} {tuple(residual.shape)}" if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise Refused("malformed", f"the error feedback residual is {shape}, the model's is torch.float32 ({self.numel},)")
        bad = non_finite(residual)
        if bad:
            raise Refused("non-finite", f"{bad} of the error feedback residual's {self.numel} values are NaN or infinite")
        self.residual = residual.clone()
