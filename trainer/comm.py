"""The DDP gradient exchange, as comm hooks that time themselves and can send fp16.

``flat``: one all-reduce over every rank of the job (a ring that crosses region boundaries).
``hierarchical``: gradients are summed onto each region's leader, the leaders all-reduce over the
long links, and each leader broadcasts the result in its region; the bytes that cross regions then
grow with the number of regions, not of ranks.

fp16 halves the bytes each step puts on a long link (with ``hierarchical`` it applies to the
cross-region hop only); near convergence the rounding matters more than the bandwidth, so the hook
switches to fp32 from ``fp32_after_step`` on.

In a process group of one rank (a one-rank region under DiLoCo, or a one-rank job) there is no
gradient to exchange: ``for_sync`` returns the model itself, without DDP and without a hook, so
the step's ``comm_s`` is 0 because nothing runs, not because a cost went unmeasured.

Cross-region bytes are counted from the ring all-reduce's traffic (each member sends 2(n-1)/n of
the buffer to its ring successor): a model of what gloo and NCCL's ring send, not a measurement
(``geoshard.wan`` measures them on its links).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.loaders.topology import Topology


@dataclass
class CommState:
    topology: Topology
    compression: str = "none"  # "none" | "fp16"
    fp32_after_step: int | None = None
    step: int = 0
    buckets: int = 0
    first_start: float | None = None  # buckets overlap: the step's sync time is first hand-off to last result
    last_done: float = 0.0
    intra_s: float = 0.0
    cross_s: float = 0.0
    cross_bytes: int = 0
    group: Any = field(default=None, repr=False)

    def fp16_now(self) -> bool:
        return self.compression == "fp16" and (self.fp32_after_step is None or self.step < self.fp32_after_step)

    @property
    def seconds(self) -> float:
        return 0.0 if self.first_start is None else max(0.0, self.last_done - self.first_start)

    def take(self) -> tuple[float, float, float, int]:
        """The step's (sync seconds, in-region seconds, cross-region seconds, cross-region bytes); resets."""
        out = (self.seconds, self.intra_s, self.cross_s, self.cross_bytes)
        self.first_start, self.last_done, self.buckets = None, 0.0, 0
        self.intra_s = self.cross_s = 0.0
        self.cross_bytes = 0
        return out


def resolve_sync(requested: str, topology: Topology) -> str:
    """``auto``: hierarchical when the job spans regions, else flat."""
    if requested != "auto":
        return requested
    return "hierarchical" if topology.spans_regions else "flat"


def for_sync(model: nn.Module, comm: CommState, sync: str, group_size: int, device_ids: list[int] | None) -> nn.Module:
    """The module the loop runs forward and backward on: DDP with the sync's timed hook, or
    ``model`` itself when the group has one rank (its all-reduce would return the input; measured
    in docs/benchmarks.md, DiLoCo utilization: under load it still cost a wait for gloo's thread)."""
    if group_size == 1:
        return model
    ddp = DDP(model, device_ids=device_ids)
    ddp.register_comm_hook(comm, hierarchical_hook if sync == "hierarchical" else timed_allreduce_hook)
    return ddp


def flat_ring_cross_bytes(topology: Topology, nbytes: int) -> int:
    """Bytes this rank sends to another region in a ring all-reduce over the whole job (ring in rank order)."""
    w = topology.world_size
    if w < 2 or topology.regions[(topology.rank + 1) % w] == topology.region:
        return 0
    return 2 * (w - 1) * nbytes // w


def timed_allreduce_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    if state.first_start is None:
        state.first_start = t0
    buf = bucket.buffer()
    world = dist.get_world_size(state.group)
    fp16 = state.fp16_now() and buf.dtype == torch.float32
    tensor = buf.to(torch.float16) if fp16 else buf
    tensor.div_(world)
    state.cross_bytes += flat_ring_cross_bytes(state.topology, tensor.numel() * tensor.element_size())
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()  # type: ignore[union-attr]

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = f.value()[0]
        if fp16:
            buf.copy_(out)
        state.last_done = max(state.last_done, time.perf_counter())
        state.buckets += 1
        return buf

    return fut.then(done)


def hierarchical_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce onto the region leader, all-reduce among leaders, broadcast in the region.

    Done synchronously inside the hook: the three steps depend on each other, and a collective
    issued from a future's callback would run on gloo's thread. The time is the same on gloo."""
    topo = state.topology
    clock = time.perf_counter
    t0 = clock()
    if state.first_start is None:
        state.first_start = t0
    buf = bucket.buffer()
    in_region = topo.region_size > 1
    if in_region:
        dist.reduce(buf, dst=topo.leader, group=topo.region_group)
    t1 = clock()
    if topo.is_leader:
        buf.div_(topo.world_size)  # before any fp16 cast: the sum of every rank could overflow it
        if len(topo.leaders) > 1:
            fp16 = state.fp16_now() and buf.dtype == torch.float32
            tensor = buf.to(torch.float16) if fp16 else buf
            dist.all_reduce(tensor, group=topo.leader_group)
            if fp16:
                buf.copy_(tensor)
            n = len(topo.leaders)
            state.cross_bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
    t2 = clock()
    if in_region:
        dist.broadcast(buf, src=topo.leader, group=topo.region_group)
    t3 = clock()
    state.intra_s += (t1 - t0) + (t3 - t2)
    state.cross_s += t2 - t1
    state.last_done = max(state.last_done, t3)
    state.buckets += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
