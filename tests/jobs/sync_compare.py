"""Run by torchrun in tests/test_multiregion.py: four gloo ranks in three regions (2+1+1) train the
demo model from one seed on per-rank random batches, with flat and with hierarchical gradient
sync, with and without fp16 and accumulation; rank 0 writes every run's final parameters' distance
to the flat fp32 run and the cross-region bytes each sync counted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.loaders.topology import Topology
from geoshard.local.synth import NUM_CLASSES
from geoshard.trainer.comm import CommState, hierarchical_hook, timed_allreduce_hook
from geoshard.trainer.exit import exit_rank
from geoshard.trainer.loop import forward_backward
from geoshard.trainer.model import INPUT_BYTES, Net

REGIONS = ["us-east-1", "us-east-1", "eu-west-1", "ap-southeast-1"]
STEPS, BATCH = 6, 16


def run(topo: Topology, sync: str, compression: str, accum: int) -> tuple[list[torch.Tensor], list[int]]:
    torch.manual_seed(0)
    net = Net(64)
    ddp = DDP(net)
    comm = CommState(topo, compression)
    ddp.register_comm_hook(comm, hierarchical_hook if sync == "hierarchical" else timed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + topo.rank)
    cross = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(accum):
            x = torch.rand(BATCH // accum, INPUT_BYTES, generator=g)
            y = torch.randint(0, NUM_CLASSES, (BATCH // accum,), generator=g)
            forward_backward(ddp, x, y, accum, last=micro == accum - 1)
        opt.step()
        cross.append(comm.take()[3])
    return [p.detach().clone() for p in net.parameters()], cross


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    topo = Topology.discover(REGIONS[dist.get_rank()])
    results = {}
    base, _ = run(topo, "flat", "none", 1)
    for compression in ("none", "fp16"):
        for accum in (1, 2):
            ref, flat_bytes = run(topo, "flat", compression, accum)
            hier, hier_bytes = run(topo, "hierarchical", compression, accum)
            diff = max(float((a - b).abs().max()) for a, b in zip(ref, hier, strict=True))
            scale = max(float(a.abs().max()) for a in ref)
            to_base = max(float((a - b).abs().max()) for a, b in zip(base, hier, strict=True))
            # Every rank must hold the same parameters after a step (DDP's invariant).
            gathered: list[object] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, [t.sum().item() for t in hier])
            bytes_all: list[object] = [None] * dist.get_world_size()
            dist.all_gather_object(bytes_all, [sum(flat_bytes), sum(hier_bytes)])
            results[f"{compression}-accum{accum}"] = {
                "max_abs_diff": diff,
                "param_scale": scale,
                "to_flat_fp32": to_base,
                "ranks_agree": all(g == gathered[0] for g in gathered),
                "flat_cross_bytes": sum(b[0] for b in bytes_all),  # type: ignore[index]
                "hier_cross_bytes": sum(b[1] for b in bytes_all),  # type: ignore[index]
            }
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in Net(64).parameters())
        out.write_text(json.dumps({"results": results, "params": params, "steps": STEPS}, indent=1))
    dist.destroy_process_group()
    exit_rank(0)  # DDP keeps gloo's threads alive into finalization (trainer/exit.py)


if __name__ == "__main__":
    main()
