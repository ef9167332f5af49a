"""Where one MAC projection pass goes (trainer/diloco/mac.py; issue 23 part 3), by phase, at
several shard sizes, beside the pass it replaced (4 standard-normal float32 vectors from
torch.Generator, cast to float64, one matrix-vector product per 4M-value piece), in the same run.

    .venv/bin/python bench/mac_profile.py                      # 2.8M, 11M and 45M values
    .venv/bin/python bench/mac_profile.py --sizes 11 --repeats 3

Prints one line per size and pass: seconds per phase (the median of ``--repeats``), the total,
the new over the old, and the 1-minute load average when measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from geoshard.trainer.diloco import mac
from geoshard.trainer.diloco.auth import Signer

OLD_K = 4


def old_pass(x: torch.Tensor, t: dict[str, float]) -> None:
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(OLD_K)]
    acc = torch.zeros(OLD_K, dtype=torch.float64)
    for start in range(0, x.numel(), mac.CHUNK):
        n = min(mac.CHUNK, x.numel() - start)
        a = time.perf_counter()
        v = torch.stack([torch.randn(n, generator=g, dtype=torch.float32) for g in gens])
        b = time.perf_counter()
        piece, vd = x[start : start + n].to(torch.float64), v.double()
        c = time.perf_counter()
        acc += torch.mv(vd, piece)
        t["draw"] += b - a
        t["cast"] += c - b
        t["matvec"] += time.perf_counter() - c


def new_pass(x: torch.Tensor, t: dict[str, float], signer: Signer) -> None:
    """``mac.project``'s steps, timed: the codes' draw, the float64 cast of each block, the buckets."""
    buckets = torch.zeros(1 << mac.K, dtype=torch.float64)
    square = torch.zeros((), dtype=torch.float64)
    draw = mac._draw(mac._seeds(signer, "profile", 0), x.numel(), x.device)
    start = 0
    while True:
        a = time.perf_counter()
        codes = next(draw, None)
        t["draw"] += time.perf_counter() - a
        if codes is None:
            break
        for i in range(0, codes.numel(), mac.BLOCK):
            b = time.perf_counter()
            block = x[start + i : start + i + mac.BLOCK].to(torch.float64)
            c = time.perf_counter()
            buckets.index_add_(0, codes[i : i + mac.BLOCK].to(torch.int32), block)
            square += torch.dot(block, block)
            t["cast"] += c - b
            t["buckets"] += time.perf_counter() - c
        start += codes.numel()
    a = time.perf_counter()
    mac._signs(x.device).T @ buckets
    t["buckets"] += time.perf_counter() - a


def measure(run: Callable[[dict[str, float]], None], phases: tuple[str, ...], repeats: int) -> dict[str, float]:
    rows = []
    for _ in range(repeats):
        t = dict.fromkeys(phases, 0.0)
        run(t)
        rows.append(t)
    return {k: statistics.median(r[k] for r in rows) for k in phases}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2.8,11,45", help="shard sizes, millions of values")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    signer = Signer(b"mac-profile-secret-0123456789abcdef")
    for size in (float(s) for s in args.sizes.split(",")):
        x = torch.randn(int(size * 1e6)).half()
        old = measure(lambda t, x=x: old_pass(x, t), ("draw", "cast", "matvec"), args.repeats)
        load_old = os.getloadavg()[0]
        new = measure(lambda t, x=x: new_pass(x, t, signer), ("draw", "cast", "buckets"), args.repeats)
        a = time.perf_counter()
        mac.project(signer, "profile", 0, x)
        whole = time.perf_counter() - a
        load = os.getloadavg()[0]
        o, n = sum(old.values()), sum(new.values())
        phases = ", ".join(f"{k} {v:.3f}" for k, v in old.items())
        print(f"{size:g}M values, old (K=4 normal): {o:.3f} s = {phases} (load {load_old:.1f})")
        print(
            f"{size:g}M values, new (K=15 signs): {n:.3f} s = "
            + ", ".join(f"{k} {v:.3f}" for k, v in new.items())
            + f"; mac.project {whole:.3f} s; new/old {n / o:.2f} (load {load:.1f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
