"""Run by torchrun in tests/test_one_rank_region.py: each rank of a one-region world builds the
loop's module with ``for_sync``, takes one backward on its own random batch, and writes what the
loop would record (the module kind, the comm state's take) beside its gradients against plain
autograd on its own batch and on every rank's batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.loaders.topology import Topology
from geoshard.local.synth import NUM_CLASSES
from geoshard.trainer.comm import CommState, for_sync
from geoshard.trainer.exit import exit_rank
from geoshard.trainer.loop import forward_backward
from geoshard.trainer.model import INPUT_BYTES, Net

BATCH = 16


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.rand(BATCH, INPUT_BYTES, generator=g), torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)


def grads_of(model: Net) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def plain_grads(rank: int) -> torch.Tensor:
    """Autograd alone on ``rank``'s batch, from the same initial parameters."""
    torch.manual_seed(0)
    model = Net(64)
    x, y = batch(rank)
    F.cross_entropy(model(x), y).backward()
    return grads_of(model)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.discover("us-east-1")
    torch.manual_seed(0)
    model = Net(64)
    comm = CommState(topo)
    net = for_sync(model, comm, "flat", world, None)
    x, y = batch(rank)
    forward_backward(net, x, y, 1, last=True)
    got = grads_of(model)
    every: list[torch.Tensor] = [torch.zeros_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    mean = torch.stack([plain_grads(r) for r in range(world)]).mean(0)
    result = {
        "ddp": isinstance(net, DDP),
        "take": list(comm.take()),
        "between_ranks": max(float((a - got).abs().max()) for a in every),
        "to_mean_of_ranks": float((got - mean).abs().max()),
        "to_own_batch": float((got - plain_grads(rank)).abs().max()),
        "scale": float(got.abs().max()),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    exit_rank(0)  # DDP keeps gloo's threads alive into finalization (trainer/exit.py)


if __name__ == "__main__":
    main()
