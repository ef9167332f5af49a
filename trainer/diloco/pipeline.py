"""The pipelined middle of a peer-to-peer round (``p2p``): what used to wait for the whole
transfer now runs on each piece of the sum as it arrives.

Each owned shard travels in up to ``sharded.WAVES`` waves, contiguous parts of the shard that
halve in size (1/2, 1/4, 1/8, 1/8 for 4), each wave cut over the streams' groups and queued
behind the previous one on the same group (``sharded.start_waves``). ``WAVES`` is 1: more waves
on the same groups slowed the transfer more than they hid (docs/benchmarks.md, exchange_bench).
Inside a wave the streams' chunks land seconds apart (a quarter of the wire time between the
first and the last at 360 MB), so each chunk is taken as it lands, in order (``land``), on this
thread, a block of ``BLOCK`` values at a time:

- its values are added into the shard's MAC buckets (``mac.Projector``; the projections are
  linear), so after the transfer only the last chunks' pass and K comparisons are left;
- when staged (``Pipeline.stage``): the outer Nesterov step is taken on it into staging buffers (the outer
  parameters and momentum are not touched); once the wave's last chunk is in (``landed``), the
  region's ranks start gathering its new parameters (one broadcast per shard from its owner, on
  the region's group) while later waves travel.

This host pass, not the wire, was what the round lost to the bare streams: at 1.8e8 values a
rank's step over whole tensors (fresh temporaries and staging, every page mapped on first write)
took 5 s alone on a quiet core, 10-30 s on the busy shared ones, all of it after the wire.
Blocks, staging written while the wire is busy (``stage``) and chunks taken as they land leave
the last chunk's share (docs/benchmarks.md, exchange_bench).

The round commits the staging only when the region's one agreement flag says every shard was
sound (``p2p._member``): a refused or failed round leaves the outer parameters and momentum as
they were, and gathers again without the staging. Every rank of a region posts the same
broadcasts in the same order whatever happened (``finish``), so a failed wave never leaves the
region's group out of step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed import BroadcastOptions

from geoshard.trainer.diloco import mac
from geoshard.trainer.diloco.auth import Signer
from geoshard.trainer.diloco.settings import OuterSync
from geoshard.trainer.diloco.sharded import waves
from geoshard.trainer.diloco.shards import Layout, owner

PASS_THREADS = 1  # intra-op threads of the exchange's host passes (``one_thread``)


@contextmanager
def one_thread() -> Iterator[None]:
    """The exchange's host passes (MAC projections, staged step) with ``PASS_THREADS`` intra-op
    threads, then the caller's count again. Each rank's default (one thread a core) put 3-6 ranks
    x 2 spinning OpenMP threads on 2 shared cores: the same pass over 4.5e7 values in three
    processes at once took 13-20 s each, with one thread 0.4-0.75 s (docs/benchmarks.md). The
    passes run under the wire, chunk by chunk, so one thread a rank is enough on a big node too."""
    before = torch.get_num_threads()
    torch.set_num_threads(PASS_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


BLOCK = 1 << 18  # values of a landed wave taken at a time (1 MB in fp32): what its pass reads stays in the cache


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
        self._parts = 0  # parts of wave ``landed_waves`` landed so far
        self._offset = layout.offsets()
        self.gather: Gather | None = None
        self.staged_p: torch.Tensor | None = None
        self.staged_m: torch.Tensor | None = None

    def stage(self, gather: Gather, params: torch.Tensor, momentum: torch.Tensor | None, m: int, sync: OuterSync) -> None:
        """Speculate: each landed wave's outer step (mean: the sum over ``m``) into staging, then its
        gather. Called once the waves travel: the staging and the gather's buffer are written here
        (zeros), so their pages are mapped while the wire is busy, not by the passes after it (at
        1.8e8 values the first writes to these three buffers cost more than the step itself)."""
        self.gather, self._step = gather, (params, momentum, m, sync)
        with one_thread():
            self.staged_p = torch.zeros_like(params)
            self.staged_m = torch.zeros_like(params)
            gather.full.zero_()

    def land(self, w: int, i: int) -> None:
        """Part ``i`` of wave ``w`` summed (``spans[w][i]``, one chunk's work; parts in order): into
        the MAC buckets and (staged) stepped, while the wave's later chunks still travel. One pass a
        block of ``BLOCK`` values at a time: the buckets, the step and the copy into the gather
        read each block while it is in the cache, not each the whole part from memory."""
        assert (w, i) == (self.landed_waves, self._parts), ((w, i), (self.landed_waves, self._parts))
        s, a, b = self.spans[w][i]
        offset = self._offset[s]
        with one_thread():
            for x in range(a, b, BLOCK):
                y = min(b, x + BLOCK)
                self.projectors[s].add(self.values[s][x:y])
                if self.gather is not None:
                    self._stage_block(s, offset, x, y)
        self._parts = i + 1

    def landed(self, w: int) -> None:
        """Wave ``w`` summed: its parts not landed yet (``land``), then its gather posted."""
        for i in range(self._parts, len(self.spans[w])):
            self.land(w, i)
        if self.gather is not None:
            self.gather.post(w)
        self.landed_waves, self._parts = w + 1, 0

    def _stage_block(self, s: int, i: int, a: int, b: int) -> None:
        """Values ``[a, b)`` of shard ``s`` (at ``i`` in the rank's own vector): stepped into staging and copied into the gather."""
        assert self.gather is not None and self.staged_p is not None and self.staged_m is not None
        params, momentum, m, sync = self._step
        g = self.values[s][a:b].to(torch.float32, copy=True)  # a copy also when the sum is fp32 ("none")
        g /= m  # the mean, as ``sum.float() / m``
        buf = None if momentum is None else momentum[i + a : i + b]
        outer_step(params[i + a : i + b], buf, g, sync, self.staged_p[i + a : i + b], self.staged_m[i + a : i + b])
        start = self.layout.span(s)[0]
        self.gather.full[start + a : start + b] = self.staged_p[i + a : i + b]

    def projections(self) -> dict[int, list[float]]:
        return {s: p.result() for s, p in self.projectors.items()}
