"""The outer optimizer on a region leader: the outer parameters (flat fp32) and their Nesterov SGD,
and the outer state (parameters, momentum) each round publishes, so that a region that starts or
falls behind takes it instead of its own (live recovery)."""

from __future__ import annotations

import contextlib
import io
import time

import torch

from geoshard.trainer.diloco.kv import KV, POLL_S, OuterSyncError
from geoshard.trainer.diloco.settings import OuterSync


def latest(kv: KV) -> int | None:
    """The newest round whose state is published; None before the job's first."""
    value = kv.get_if(kv.key("latest"))
    return None if value is None else int(value)


class OuterOptimizer:
    def __init__(self, sync: OuterSync) -> None:
        self.sync = sync
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
        kv.store.set(kv.key("latest"), str(r))
        return len(payload)

    def load(self, kv: KV, r: int, device: torch.device) -> tuple[int, int, int]:
        """Adopt the state published for round ``r``: (round, step, bytes read); KeyError when it is gone."""
        key = kv.key("state", r)
        if not kv.store.check([key]):
            raise KeyError(r)
        (payload,) = kv.fetch([key])
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location=device)
        self.reset(state["params"], state["momentum"])
        return int(state["round"]), int(state["step"]), len(payload)

    def adopt_latest(self, kv: KV, at_least: int, device: torch.device) -> tuple[int, int, int]:
        """Load the newest published state once it is round ``at_least`` or later: (its round, its step, bytes read)."""
        deadline = time.monotonic() + self.sync.round_timeout_s
        while True:
            newest = latest(kv)
            if newest is not None and newest >= at_least:
                with contextlib.suppress(KeyError):  # a newer round's closer may have just dropped it
                    return self.load(kv, newest, device)
            if time.monotonic() > deadline:
                raise OuterSyncError(f"DiLoCo: no outer state of round {at_least} or later within {self.sync.round_timeout_s:g} s")
            time.sleep(POLL_S)
