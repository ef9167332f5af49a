"""The pipelined middle of a peer-to-peer round (``p2p``): what used to wait for the whole
transfer now runs on each piece of the sum as it arrives.

Each owned shard travels in up to ``sharded.WAVES`` waves, contiguous parts of the shard that
halve in size (1/2, 1/4, 1/8, 1/8 for 4), each wave cut over the streams' groups and queued
behind the previous one on the same group (``sharded.start_waves``). ``WAVES`` is 1: more waves
on the same groups slowed the transfer more than they hid (docs/benchmarks.md, exchange_bench).
As a wave lands, on this thread:

- its values are added into the shard's MAC buckets (``mac.Projector``; the projections are
  linear), so after the transfer only the last waves' pass and K comparisons are left;
- when staged (``Pipeline.stage``): the outer Nesterov step is taken on it into staging buffers (the outer
  parameters and momentum are not touched), and the region's ranks start gathering its new
  parameters (one broadcast per shard from its owner, on the region's group) while later waves
  travel.

The round commits the staging only when the region's one agreement flag says every shard was
sound (``p2p._member``): a refused or failed round leaves the outer parameters and momentum as
they were, and gathers again without the staging. Every rank of a region posts the same
broadcasts in the same order whatever happened (``finish``), so a failed wave never leaves the
region's group out of step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import BroadcastOptions

from geoshard.trainer.diloco import mac
from geoshard.trainer.diloco.auth import Signer
from geoshard.trainer.diloco.settings import OuterSync
from geoshard.trainer.diloco.sharded import waves
from geoshard.trainer.diloco.shards import Layout, owner


def outer_step(
    p: torch.Tensor, buf: torch.Tensor | None, g: torch.Tensor, sync: OuterSync, p_out: torch.Tensor, m_out: torch.Tensor
) -> None:
    """torch.optim.SGD's step (no weight decay, no dampening, Nesterov when set), elementwise, on a
    slice: new parameters into ``p_out``, new momentum into ``m_out``; ``p`` and ``buf`` untouched."""
    mu, lr = sync.outer_momentum, sync.outer_lr
    if mu == 0:
        torch.add(p, g, alpha=-lr, out=p_out)
        return
    if buf is None:  # SGD's first step: the buffer starts as the gradient
        m_out.copy_(g)
    else:
        torch.mul(buf, mu, out=m_out)
        m_out.add_(g)
    d = g.add(m_out, alpha=mu) if sync.nesterov else m_out
    torch.add(p, d, alpha=-lr, out=p_out)


class Gather:
    """The region's gather of one attempt's staged parameters, a wave at a time: made before the
    attempt starts (so every rank of the region posts the same broadcasts whatever happens to its
    attempt), posted as waves land, the rest posted by ``finish``."""

    def __init__(self, layout: Layout, region_group: Any, count: int) -> None:
        self.layout, self.region_group, self.count = layout, region_group, count
        self.full = torch.empty(layout.numel, dtype=torch.float32)
        self.posted = 0
        self._works: list[Any] = []

    def post(self, w: int) -> None:
        """Wave ``w``'s broadcasts (after waves before it): every shard's part from its owner, in
        shard order, the same list on every rank of the region."""
        assert w == self.posted, (w, self.posted)
        self.posted = w + 1
        if self.region_group is None:
            return
        for s in range(self.layout.shards):
            a, b = self.layout.span(s)
            x, y = waves(b - a, self.count)[w]
            opts = BroadcastOptions()
            opts.rootRank = owner(s, self.layout.n)
            self._works.append(self.region_group.broadcast([self.full[a + x : a + y]], opts))

    def finish(self, landed: int) -> bool:
        """Post the waves not posted yet (what they carry is dropped) and wait for every broadcast;
        True when all ``count`` waves had landed and every rank of the region holds ``full``."""
        whole = landed == self.count
        while self.posted < self.count:
            self.post(self.posted)
        try:
            for work in self._works:
                work.wait()
        except RuntimeError:
            return False
        return whole


class Pipeline:
    """One attempt's waves on one rank: the MAC buckets, and (with a ``Gather``) the staged step."""

    def __init__(
        self, layout: Layout, signer: Signer, tag: str, values: dict[int, torch.Tensor], spans: Sequence[Sequence[tuple[int, int, int]]]
    ) -> None:
        self.layout, self.values, self.spans = layout, values, spans
        self.projectors = {s: mac.Projector(signer, tag, s, t.numel(), t.device) for s, t in values.items()}
        self.landed_waves = 0
        self.gather: Gather | None = None
        self.staged_p: torch.Tensor | None = None
        self.staged_m: torch.Tensor | None = None

    def stage(self, gather: Gather, params: torch.Tensor, momentum: torch.Tensor | None, m: int, sync: OuterSync) -> None:
        """Speculate: each landed wave's outer step (mean: the sum over ``m``) into staging, then its gather."""
        self.gather, self._step = gather, (params, momentum, m, sync)
        self.staged_p = torch.empty_like(params)
        self.staged_m = torch.empty_like(params)

    def landed(self, w: int) -> None:
        """Wave ``w`` summed: into the MAC buckets, and (staged) stepped and its gather posted."""
        assert w == self.landed_waves, (w, self.landed_waves)
        for s, a, b in self.spans[w]:
            self.projectors[s].add(self.values[s][a:b])
        if self.gather is not None:
            assert self.staged_p is not None and self.staged_m is not None
            params, momentum, m, sync = self._step
            offset = {s: i for s, i in _offsets(self.layout)}
            for s, a, b in self.spans[w]:
                i, start = offset[s], self.layout.span(s)[0]
                g = self.values[s][a:b].float() / m
                buf = None if momentum is None else momentum[i + a : i + b]
                outer_step(params[i + a : i + b], buf, g, sync, self.staged_p[i + a : i + b], self.staged_m[i + a : i + b])
                self.gather.full[start + a : start + b] = self.staged_p[i + a : i + b]
            self.gather.post(w)
        self.landed_waves = w + 1

    def projections(self) -> dict[int, list[float]]:
        return {s: p.result() for s, p in self.projectors.items()}


def _offsets(layout: Layout) -> list[tuple[int, int]]:
    """(shard, its offset in the rank's own vector) per owned shard."""
    out, i = [], 0
    for s in layout.mine:
        a, b = layout.span(s)
        out.append((s, i))
        i += b - a
    return out
