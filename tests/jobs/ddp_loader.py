"""Run by torchrun in tests/test_loaders_ddp.py: each rank reads its share of a region for two
epochs through make_loader (2 workers), all-reducing once per batch as DDP would, and writes the
keys it saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from geoshard.loaders import make_loader


def main() -> None:
    plan, region, out, seed = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = make_loader(plan, region=region, batch_size=16, num_workers=2, seed=seed, shuffle_buffer=100)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        keys: list[str] = []
        for batch in loader:
            t = torch.ones(1)
            dist.all_reduce(t)  # a rank with one batch more would block here forever
            keys += batch["__key__"]
        epochs.append(keys)
    out.joinpath(f"rank{rank}.json").write_text(json.dumps({"epochs": epochs, "batches": len(loader), "stats": loader.stats()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
