"""Benchmark of ``geoshard plan optimize``'s search at three sizes, against one ``geoshard.sim``
prediction of the same job in the same run (the baseline: building its ``SimConfig``, whose
checks visit every pair of regions, and predicting it, what one ``geoshard simulate`` costs).

Sizes: 4 regions and 16 ranks, 16 and 256, 64 and 1,000; every pair of regions linked (20-140 ms
one way, 1 Gbit/s), a 10^6-parameter model, 10^9 samples (1 TB at 1 KB). The search predicts each
sync choice once per kind of placement and once assembled, never a product over regions, so its
time should be a fixed multiple of one prediction whatever the size: the ratio column. Goal: 64
regions and 1,000 ranks in <= 5 s of CPU. Reports wall and CPU time (the machine is shared: CPU
time is the figure that does not depend on the load), the median of ``--repeat`` runs.

    .venv/bin/python bench/optimize_bench.py [--repeat 3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from geoshard.optimize import OptimizeInputs, optimize
from geoshard.sim import LinkSpec, RegionSpec, SimConfig, predict
from geoshard.sim.calibrated import WAN

SIZES = ((4, 16), (16, 256), (64, 1000))
SAMPLES = 10**9


def job(regions: int, ranks: int) -> OptimizeInputs:
    names = [f"r{i}" for i in range(regions)]
    per = [ranks // regions + (1 if i < ranks % regions else 0) for i in range(regions)]
    links = tuple(LinkSpec(a, b, 20 + (i * 7 + j) % 120, 1000) for i, a in enumerate(names) for j, b in enumerate(names) if i < j)
    specs = tuple(RegionSpec(n, r, "s3", None, SAMPLES * r // ranks) for n, r in zip(names, per, strict=True))
    base = SimConfig(regions=specs, links=links, steps=SAMPLES // (32 * ranks), params=10**6, step_time=0.2, constants=WAN)
    return OptimizeInputs(base=base, corpus_bytes=SAMPLES * 1000.0, source_region="r0")


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rows = []
    print(f"load {os.getloadavg()[0]:.1f}")
    head = f"{'regions':>7} {'ranks':>5} | {'1 predict (CPU)':>15} | {'search wall':>11} {'search CPU':>10} | {'predictions':>11}"
    print(head + " | ratio | chosen")
    for regions, ranks in SIZES:
        inputs = job(regions, ranks)
        _, one_cpu, _ = timed(lambda inputs=inputs: predict(replace(inputs.base)), args.repeat)  # type: ignore[misc]
        wall, cpu, proposal = timed(lambda inputs=inputs: optimize(inputs), args.repeat)  # type: ignore[misc]
        row = {
            "regions": regions,
            "ranks": ranks,
            "predict_cpu_s": round(one_cpu, 5),
            "search_wall_s": round(wall, 4),
            "search_cpu_s": round(cpu, 4),
            "predictions": proposal.predictions,
            "ratio": round(cpu / one_cpu, 1) if one_cpu > 0 else None,
            "chosen": proposal.chosen.sync.label(),
            "load": round(os.getloadavg()[0], 1),
        }
        rows.append(row)
        print(
            f"{regions:>7} {ranks:>5} | {one_cpu * 1000:>12.2f} ms | {wall:>9.3f} s {cpu:>8.3f} s | {proposal.predictions:>11} | "
            f"{row['ratio']:>5} | {row['chosen']}"
        )
    goal = rows[-1]["search_cpu_s"] <= 5.0
    print(f"goal (64 regions, 1,000 ranks in <= 5 s CPU): {'met' if goal else 'not met'}; load {os.getloadavg()[0]:.1f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": rows, "goal_met": goal}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
