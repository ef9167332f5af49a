"""The DDP gradient all-reduce, as a comm hook that times itself and can send fp16.

fp16 halves the bytes each step puts on a long cross-region link; near convergence the rounding
matters more than the bandwidth, so the hook switches to fp32 from ``fp32_after_step`` on. The
time from the first bucket's hand-off to the last reduced result is the step's gradient-sync
time; it overlaps the backward pass.
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
    buckets: int = 0
    first_start: float | None = None  # buckets overlap: the step's sync time is first hand-off to last result
    last_done: float = 0.0
    group: dist.ProcessGroup | None = field(default=None, repr=False)

    def fp16_now(self) -> bool:
        return self.compression == "fp16" and (self.fp32_after_step is None or self.step < self.fp32_after_step)

    @property
    def seconds(self) -> float:
        return 0.0 if self.first_start is None else max(0.0, self.last_done - self.first_start)

    def take(self) -> float:
        """The step's gradient-sync time; resets for the next step."""
        s = self.seconds
        self.first_start, self.last_done, self.buckets = None, 0.0, 0
        return s


def timed_allreduce_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    if state.first_start is None:
        state.first_start = t0
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
        state.last_done = max(state.last_done, time.perf_counter())
        state.buckets += 1
        return buf

    return fut.then(done)
