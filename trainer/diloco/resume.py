"""The outer momentum in a region's checkpoint, so that a whole job resumed (``--resume`` after
every region stopped) continues its outer optimizer instead of starting Nesterov's momentum from
zero: the region's leader saves the momentum as of the last round the region took, and on resume
the job's first region hands its own to every region in round 0 (through the store, or peer to
peer beside its parameters).

Under p2p every rank holds its shards of the momentum; the checkpoint gathers them to the leader
only (it alone saves them), over the region's training group, never the exchange's own group,
which a round in flight may be using. The owners send their shards in pieces of ``PIECE`` values,
so a rank other than the leader never holds more than its own shards and one piece.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.codec import non_finite
from geoshard.trainer.diloco.shards import Layout, owner

PIECE = 1 << 22  # values a message: 16 MB of fp32, the most a sending rank copies at once (to a device)


def checked_momentum(value: Any, numel: int) -> torch.Tensor:
    """A checkpoint's outer momentum: a finite flat float32 tensor of the model's size, else Refused."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or tuple(value.shape) != (numel,):
        what = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise Refused("malformed", f"the outer momentum must be float32 of shape ({numel},), got {what}")
    bad = non_finite(value)
    if bad:
        raise Refused("non-finite", f"{bad} of the outer momentum's values are NaN or infinite")
    return value.detach().cpu().clone()


def gathered(held: torch.Tensor | None, layout: Layout, group: Any, device: torch.device) -> torch.Tensor | None:
    """Collective in the region (``group``: its training group, None for one rank): each rank's
    shards of the momentum (``held``, in ``layout.mine`` order) → the whole vector on the leader
    (in-region rank 0, on the CPU), None on the other ranks; None on every rank when any rank
    holds none (before the first outer step). ``device``: the model's; the messages live there,
    except on gloo (the CPU)."""
    flag = torch.tensor([0 if held is None else 1], device=device)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if held is None or int(flag.item()) == 0:
        return None
    at = layout.offsets()
    if group is not None and dist.get_backend(group) == "gloo":
        device = torch.device("cpu")  # gloo's send and recv take CPU tensors only
    if layout.k != 0:
        for s in layout.mine:
            a, b = layout.span(s)
            for c, e in pieces(a, b):
                dist.send(held[at[s] + c - a : at[s] + e - a].to(device), group=group, group_dst=0)
        return None
    full = torch.empty(layout.numel, dtype=torch.float32)
    for s in layout.mine:
        a, b = layout.span(s)
        full[a:b] = held[at[s] : at[s] + b - a]
    buf = None if device.type == "cpu" else torch.empty(min(PIECE, layout.numel), dtype=torch.float32, device=device)
    for s in range(layout.shards):  # in shard order: each owner sends its shards in that order too
        if (src := owner(s, layout.n)) == 0:
            continue
        for c, e in pieces(*layout.span(s)):
            into = full[c:e] if buf is None else buf[: e - c]
            dist.recv(into, group=group, group_src=src)
            if buf is not None:
                full[c:e] = into
    return full


def pieces(a: int, b: int) -> list[tuple[int, int]]:
    """[a, b) cut into messages of at most ``PIECE`` values."""
    return [(c, min(c + PIECE, b)) for c in range(a, b, PIECE)]
