"""A batch's hand-off from a DataLoader worker against how long the worker sat idle before it
(issue 21: the simulator's per-batch hand-off is one constant, and the hierarchical runs, whose
steps are 2-3 s, measured twice the others'). One worker, batches of 32 samples of 3,585 bytes (the
simulate_bench corpus's stored size), already prefetched; the consumer sleeps, then times next().
The sleeps are shuffled so that a drift of the host does not read as an effect of the idle.

    .venv/bin/python bench/handoff_probe.py --repeats 12
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

IDLE_S = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


class Samples(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield torch.zeros(3585, dtype=torch.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    it = iter(DataLoader(Samples(), batch_size=32, num_workers=1, prefetch_factor=2))
    next(it), next(it)
    order = list(IDLE_S) * args.repeats
    random.Random(1).shuffle(order)
    waits: dict[float, list[float]] = {s: [] for s in IDLE_S}
    for idle in order:
        time.sleep(idle)
        t0 = time.perf_counter()
        next(it)
        waits[idle].append(time.perf_counter() - t0)
    for idle in IDLE_S:
        print(f"idle {idle:g} s: hand-off median {statistics.median(waits[idle]) * 1e3:.3f} ms ({len(waits[idle])} batches)")


if __name__ == "__main__":
    main()
