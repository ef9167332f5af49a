"""Benchmark of following a refresh (issue 19): what moving to a new generation at an epoch
boundary costs a running job, against a job that restarts from scratch on the new generation.

One region on a local SeaweedFS bucket (no replica: every byte comes from the bucket). Generation
1 is ``--samples`` synthetic WebDataset samples of ``--sample-bytes`` in one source tar per 1,000
samples; generation 2 adds one source of ``--added`` samples (``geoshard refresh``). The job is
``make_loader(..., follow_refresh=True)`` read through ``stream()`` with a stated compute time per
batch (``--step-ms``): epochs 0 and 1 on generation 1, the refresh published during epoch 1 (its
time not counted), so epoch 2 is the switching epoch, then epoch 3.

- **Boundary stall**: the consumer's data wait from the batch at which the next epoch's workers
  start (``lookahead`` batches before the end: where the ranks agree the generation) through the
  next epoch's first batch. The ordinary boundaries (0 to 1, 2 to 3) against the switching one
  (1 to 2).
- **Bytes fetched** in the switching epoch, against the first epoch of a new loader made on
  generation 2 (the restart), whose stall is its time to first batch.

Ratios are within one run (same machine, same server). Results print and go to ``--json-out``.

    .venv/bin/python bench/generation_bench.py            # about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from geoshard.formats import wds
from geoshard.loaders import make_loader
from geoshard.local.seaweed import SeaweedS3

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGION = "us-east-1"


def write_source(path: Path, prefix: str, n: int, size: int) -> None:
    with open(path, "wb") as f:
        w = wds.TarWriter(f)
        for i in range(n):
            key = f"{prefix}{i:06d}"
            w.write_sample([(f"{key}.bin".encode(), os.urandom(size)), (f"{key}.cls".encode(), b"1")])
        w.close()


def refresh(src: Path, plan: Path, out: Path) -> float:
    t0 = time.perf_counter()
    argv = [GEOSHARD, "refresh", str(src), "--plan", str(plan), "--out", str(out), "--create-buckets", "--json"]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - t0


def tier_bytes(stats: dict[str, Any]) -> int:
    return sum(int(t.get("bytes", 0)) for t in stats.get("tiers", {}).values())


def timed_epochs(it: Iterator[Any], per_epoch: list[int], on_batch: Any) -> list[list[float]]:
    """The consumer's wait for every batch, by epoch; ``on_batch(epoch, index)`` runs after each."""
    waits: list[list[float]] = []
    for epoch, n in enumerate(per_epoch):
        waits.append([])
        for i in range(n):
            t0 = time.perf_counter()
            next(it)
            waits[-1].append(time.perf_counter() - t0)
            on_batch(epoch, i)
    return waits


def boundary(waits: list[list[float]], epoch: int, lookahead: int) -> float:
    """Wait from the lookahead point of ``epoch`` through the first batch of the next one."""
    return sum(waits[epoch][-lookahead:]) + waits[epoch + 1][0]


def run(args: argparse.Namespace, server: SeaweedS3, work: Path) -> dict[str, Any]:
    src, out = work / "src", work / "split"
    src.mkdir()
    for i in range(0, args.samples, 1000):
        write_source(src / f"part-{i // 1000:03d}.tar", f"a{i // 1000:03d}-", min(1000, args.samples - i), args.sample_bytes)
    plan = work / "plan.toml"
    region = f'[regions.{REGION}]\nweight = 1\nbucket = "s3://genbench/train"\nendpoint = "{server.endpoint}"\n'
    plan.write_text(f'[shards]\nbytes = "{args.shard_bytes}"\n{region}')
    refresh(src, plan, out)
    kw: dict[str, Any] = {"batch_size": args.batch_size, "num_workers": args.num_workers, "lookahead": args.lookahead, "seed": 0}
    loader = make_loader(plan, REGION, follow_refresh=True, **kw)
    first = len(loader.dataset)
    step = args.step_ms / 1000
    published: dict[str, float] = {}
    bytes_at: dict[int, int] = {}

    def on_batch(epoch: int, i: int) -> None:
        time.sleep(step)
        if epoch == 1 and i == 0:
            write_source(src / "added.tar", "b-", args.added, args.sample_bytes)
            published["refresh_s"] = refresh(src, plan, out)
        if i == 0:
            bytes_at[epoch] = tier_bytes(loader.stats())

    per_epoch = [first, first, -(-(args.samples + args.added) // args.batch_size), 0]
    per_epoch[3] = per_epoch[2]
    waits = timed_epochs(loader.stream(), per_epoch, on_batch)
    assert loader.dataset.generations == {0: 1, 1: 1, 2: 2, 3: 2}, loader.dataset.generations
    bytes_at[4] = tier_bytes(loader.stats())
    restart = make_loader(plan, REGION, **kw)
    t0 = time.perf_counter()
    it = iter(restart)
    ttfb = 0.0
    for i, _ in enumerate(it):
        if i == 0:
            ttfb = time.perf_counter() - t0
        time.sleep(step)
    restart_bytes = tier_bytes(restart.stats())
    ordinary = [boundary(waits, 0, args.lookahead), boundary(waits, 2, args.lookahead)]
    switching = boundary(waits, 1, args.lookahead)
    switch_bytes = bytes_at[3] - bytes_at[2]
    return {
        "refresh_s": published.get("refresh_s"),
        "ordinary_boundary_stall_s": ordinary,
        "switching_boundary_stall_s": switching,
        "restart_time_to_first_batch_s": ttfb,
        "switching_epoch_bytes": switch_bytes,
        "ordinary_epoch_bytes": bytes_at[2] - bytes_at[1],
        "restart_epoch_bytes": restart_bytes,
        "stall_switching_over_ordinary": switching / max(ordinary),
        "stall_restart_over_switching": ttfb / switching if switching else None,
        "bytes_switching_over_restart": switch_bytes / restart_bytes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--added", type=int, default=800)
    ap.add_argument("--sample-bytes", type=int, default=4096)
    ap.add_argument("--shard-bytes", default="1MB")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--lookahead", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--json-out", type=Path, default=Path("bench/_data/generation_bench.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="genbench-"))
    try:
        with SeaweedS3(work / "weed") as server:
            os.environ.update(server.env())
            for name in SeaweedS3.UNSET_ENV:
                os.environ.pop(name, None)
            result = run(args, server, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["load_1min"] = os.getloadavg()[0]
    for k, v in result.items():
        print(f"{k:36} {v}")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
