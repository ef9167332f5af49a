"""The DDP gradient all-reduce, as a comm hook that times itself and can send fp16.

fp16 halves the bytes each step puts on a long cross-region link; near convergence the rounding
matters more than the bandwidth, so the hook switches to fp32 from ``fp32_after_step`` on. The
time from a bucket's hand-off to its reduced result is summed per step: that is gradient-sync
time, which overlaps the backward pass.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommState:
    compression: str = "none"  # "none" | "fp16"
    fp32_after_step: int | None = None
    step: int = 0
    seconds: float = 0.0  # gradient-sync time of the current step
    buckets: int = 0
    group: dist.ProcessGroup | None = field(default=None, repr=False)

    def fp16_now(self) -> bool:
        return self.compression == "fp16" and (self.fp32_after_step is None or self.step < self.fp32_after_step)

    def take(self) -> float:
        s, self.seconds, self.buckets = self.seconds, 0.0, 0
        return s


def timed_allreduce_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    buf = bucket.buffer()
    world = dist.get_world_size(state.group)
    fp16 = state.fp16_now() and buf.dtype == torch.float32
    tensor = buf.to(torch.float16) if fp16 else buf
    tensor.div_(world)
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()  # type: ignore[union-attr]

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = f.value()[0]
        if fp16:
            buf.copy_(out)
        state.seconds += time.perf_counter() - t0
        state.buckets += 1
        return buf

    return fut.then(done)
