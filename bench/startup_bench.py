"""A loader's start-up from its region's bucket: iteration start to the first batch.

Every epoch of ``make_loader`` forks its DataLoader workers afresh, and each worker builds its own
tier chain: for a bucket, its own boto3 client (a forked client's pooled connections would be
shared with the parent's). This bench times what that costs, with the loader as it is (each
client its own botocore session on the process's one parsed service model, geoshard/s3.py) and,
in the same run, with the baseline: each client on a session of its own, which parses S3's
service model and endpoint rules again (geoshard before 2026-12-07).

One SeaweedFS S3 server on 127.0.0.1 holds one region's split (``geoshard synth``, ``geoshard
split``, ``geoshard sync``); the region's plan has its bucket and nothing else, so every shard is
a GET. Each measurement is a fresh process (``--child``): it builds the loader (the training
process's own chain reads the manifest, as the trainer's does), then times ``iter(loader)`` to the
first batch for ``--epochs`` epochs (the first one pays the imports of the worker's first use; it
is kept apart). The two variants alternate, ``--repeat`` times, at 1, 2 and 4 workers.

    .venv/bin/python bench/startup_bench.py                # ~2 minutes
    .venv/bin/python bench/startup_bench.py --repeat 1     # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
GEOSHARD = str(Path(sys.executable).parent / "geoshard")
VARIANTS = ("shared model", "own session")


def child(variant: str, workers: int, plan: str, epochs: int) -> int:
    """One process: the loader built, then each epoch's iteration start to its first batch."""
    import botocore.session
    from iowait_bench import REGION

    from geoshard import s3
    from geoshard.loaders import make_loader

    if variant == "own session":  # the baseline: every client parses the service model itself
        s3._botocore_session = botocore.session.get_session  # type: ignore[attr-defined]  # the bench's own swap
    loader = make_loader(plan, REGION, batch_size=32, num_workers=workers, shuffle=False)
    firsts = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        firsts.append(time.perf_counter() - t0)
        del it  # the workers end with the iteration
    print(json.dumps({"variant": variant, "workers": workers, "first_batch_s": firsts}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data" / "startup")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "startup_bench.json")
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "WORKERS", "PLAN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.child[2], args.epochs)

    from iowait_bench import BUCKET, bucket_env, make_split, region_plan, split_shard_bytes
    from servers import SeaweedS3

    args.data.mkdir(parents=True, exist_ok=True)
    split = make_split(args.data, 4000, 1000, 500)
    weed = Path(tempfile.mkdtemp(prefix="weed-", dir=args.data))
    rows: list[dict[str, Any]] = []
    try:
        with SeaweedS3(weed) as server:
            env = bucket_env(server)
            server.make_bucket(BUCKET)
            plan = region_plan(weed / "plan.toml", endpoint=server.endpoint, shard_bytes=split_shard_bytes(split))
            argv = [GEOSHARD, "sync", str(split), "--plan", str(plan)]
            r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
            if r.returncode:
                raise RuntimeError(f"geoshard sync: {r.stderr.strip()[-2000:]}")
            for rep in range(args.repeat):
                for workers in map(int, args.workers.split(",")):
                    for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                        argv = [sys.executable, "-P", __file__, "--epochs", str(args.epochs), "--child", variant, str(workers), str(plan)]
                        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
                        if r.returncode:
                            raise RuntimeError(r.stderr[-3000:])
                        row = json.loads(r.stdout.strip().splitlines()[-1]) | {"repeat": rep, "load": round(os.getloadavg()[0], 2)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(weed, ignore_errors=True)

    table = {}
    print("| workers | first epoch: shared model | own session | later epochs (median): shared model | own session | later: own / shared |")
    print("|---|---|---|---|---|---|")
    for workers in map(int, args.workers.split(",")):
        mine = {v: [r["first_batch_s"] for r in rows if r["variant"] == v and r["workers"] == workers] for v in VARIANTS}
        first = {v: statistics.median(f[0] for f in mine[v]) for v in VARIANTS}
        later = {v: statistics.median(x for f in mine[v] for x in f[1:]) for v in VARIANTS}
        ratio = later["own session"] / later["shared model"]
        table[workers] = {"first": first, "later": later, "ratio_later": round(ratio, 2)}
        cells = [f"{first[v] * 1000:.0f} ms" for v in VARIANTS] + [f"{later[v] * 1000:.0f} ms" for v in VARIANTS]
        print(f"| {workers} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
