"""The outer optimizer on a region leader: the outer parameters (flat fp32) and their Nesterov SGD,
and the outer state (parameters, momentum) each round publishes, so that a region that starts or
falls behind takes it instead of its own (live recovery). A published state is checked against the
model before it is loaded (``checks.state``); one that fails is refused, never loaded."""

from __future__ import annotations

import io
import time
from typing import Any

import torch

from geoshard.trainer.diloco import checks
from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.kv import KV, POLL_S, OuterSyncError
from geoshard.trainer.diloco.settings import OuterSync


def latest(kv: KV) -> int | None:
    """The newest round whose state is published; None before the job's first (or while the value
    there is refused: counted, and logged once)."""
    key = kv.key("latest")
    value = kv.get(key)
    if value is None:
        return None
    try:
        return checks.parse_round(value)
    except Refused as e:
        kv.signer.refuse(key, e, value)
        return None


def wait_latest(kv: KV, at_least: int, timeout_s: float) -> int:
    """Until the newest published round is ``at_least`` or later; OuterSyncError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (newest := latest(kv)) is None or newest < at_least:
        if time.monotonic() > deadline:
            raise OuterSyncError(
                f"DiLoCo: no outer state of round {at_least} or later appeared in the store within {timeout_s:g} s (key {kv.key('latest')})"
            )
        time.sleep(POLL_S)
    return newest


class OuterOptimizer:
    def __init__(self, sync: OuterSync, bounds: checks.Bounds) -> None:
        self.sync = sync
        self.bounds = bounds
        self._outer: torch.Tensor | None = None
        self._opt: torch.optim.SGD | None = None

    @property
    def params(self) -> torch.Tensor:
        """The outer parameters (flat fp32)."""
        if self._outer is None:
            raise OuterSyncError("DiLoCo: call join(store) before the first round")
        return self._outer

    def reset(self, flat: torch.Tensor, momentum: torch.Tensor | None) -> None:
        s = self.sync
        self._outer = flat.detach().clone()
        self._opt = torch.optim.SGD([self._outer], lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov and s.outer_momentum > 0)
        if momentum is not None:
            self._opt.state[self._outer]["momentum_buffer"] = momentum.clone()

    def momentum(self) -> torch.Tensor | None:
        """The outer momentum buffer (None before the first step, or without momentum)."""
        if self._opt is None:
            return None
        buf = self._opt.state.get(self.params, {}).get("momentum_buffer")
        return None if buf is None else buf

    def step(self, mean: torch.Tensor) -> None:
        """One outer step with the regions' mean pseudo-gradient."""
        assert self._opt is not None
        self.params.grad = mean
        self._opt.step()
        self.params.grad = None

    def state_bytes(self, r: int, step: int) -> bytes:
        assert self._opt is not None
        mom = self._opt.state.get(self.params, {}).get("momentum_buffer")
        buf = io.BytesIO()
        torch.save({"round": r, "step": step, "params": self.params, "momentum": mom}, buf)
        return buf.getvalue()

    def publish(self, kv: KV, r: int, step: int) -> int:
        """The state as round ``r``'s, then ``latest``; the bytes published."""
        payload = self.state_bytes(r, step)
        kv.put(kv.key("state", r), payload)
        kv.set(kv.key("latest"), str(r))
        return len(payload)

    def load(self, kv: KV, r: int, device: torch.device) -> tuple[int, int]:
        """Adopt the state published for round ``r``: (step, bytes read). KeyError when it is gone;
        Refused (counted) when it fails its signature or its checks, and nothing is loaded."""
        key = kv.key("state", r)
        if not kv.store.check([key]):
            raise KeyError(r)
        (value,) = kv.fetch([key], self.bounds.state_bytes)
        try:
            if isinstance(value, Refused):
                raise value
            params, momentum, step = checks.state(_load(value, device), self.bounds, r)
        except Refused as e:
            kv.signer.refuse(key, e, b"" if isinstance(value, Refused) else value[:4096])
            raise
        self.reset(params, momentum)
        return step, len(value)

    def adopt_latest(self, kv: KV, at_least: int, device: torch.device) -> tuple[int, int, int] | Refused:
        """Load the newest published state once it is round ``at_least`` or later: (its round, its
        step, bytes read), or why it was refused (the outer parameters stay as they were)."""
        deadline = time.monotonic() + self.sync.round_timeout_s
        while True:
            newest = wait_latest(kv, at_least, max(0.0, deadline - time.monotonic()))
            try:
                return (newest, *self.load(kv, newest, device))
            except Refused as e:
                return e
            except KeyError:  # a newer round's closer may have just dropped it
                time.sleep(POLL_S)


def _load(payload: bytes, device: torch.device) -> Any:
    """``torch.load`` of a signed state, tensors only; anything it cannot read is malformed."""
    try:
        return torch.load(io.BytesIO(payload), weights_only=True, map_location=device)
    except Exception as e:  # whatever the unpickler raises, the value is refused
        raise Refused("malformed", f"not a torch.save of tensors ({type(e).__name__})") from None
