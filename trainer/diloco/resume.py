"""The outer momentum in a region's checkpoint, so that a whole job resumed (``--resume`` after
every region stopped) continues its outer optimizer instead of starting Nesterov's momentum from
zero: the region's leader saves the momentum as of the last round the region took, and on resume
the job's first region hands its own to every region in round 0 (through the store, or peer to
peer beside its parameters).

Under p2p every rank holds its shards of the momentum; the checkpoint gathers them over the
region's training group, never the exchange's own group, which a round in flight may be using.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.shards import Layout, owner


def checked_momentum(value: Any, numel: int) -> torch.Tensor:
    """A checkpoint's outer momentum: a finite flat float32 tensor of the model's size, else Refused."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or tuple(value.shape) != (numel,):
        what = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise Refused("malformed", f"the outer momentum must be float32 of shape ({numel},), got {what}")
    if not bool(torch.isfinite(value).all()):
        raise Refused("non-finite", f"{int((~torch.isfinite(value)).sum())} of the outer momentum's values are NaN or infinite")
    return value.detach().cpu().clone()


def gathered(held: torch.Tensor | None, layout: Layout, group: Any, device: torch.device) -> torch.Tensor | None:
    """Collective in the region (``group``: its training group, None for one rank): each rank's
    shards of the momentum (``held``, in ``layout.mine`` order) → the whole vector on every rank;
    None on every rank when any rank holds none (before the first outer step)."""
    flag = torch.tensor([0 if held is None else 1], device=device)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if held is None or int(flag.item()) == 0:
        return None
    full = torch.zeros(layout.numel, dtype=torch.float32, device=device)
    i = 0
    for s in layout.mine:
        a, b = layout.span(s)
        full[a:b] = held[i : i + b - a].to(device)
        i += b - a
    if group is not None:
        for s in range(layout.shards):
            a, b = layout.span(s)
            dist.broadcast(full[a:b], group=group, group_src=owner(s, layout.n))
    return full.cpu()
