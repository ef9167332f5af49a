"""One job across three regions: what region-local data buys, and what hierarchical gradient sync
saves, measured in one run.

Setup: a synthetic corpus split for us-east-1 (weight 2), eu-west-1 and ap-southeast-1 (weight 1
each), synced to one bucket per region on a local SeaweedFS server. Each region's ranks reach
their bucket through a latency proxy (``bench/netproxy.py``, this kernel has no netem):

- ``local``: each region reads its own region's bucket: the proxy adds ``--in-region-ms`` each way;
- ``remote``: each region reads the same data from another region's bucket (us-east-1 from
  eu-west-1, eu-west-1 from ap-southeast-1, ap-southeast-1 from us-east-1): the proxy adds the
  pair's one-way latency (38, 85 and 110 ms) and holds the link to ``--cross-mbps``.

Every run is ``geoshard train --regions us-east-1:2,eu-west-1:1,ap-southeast-1:1`` (4 gloo ranks,
``--num-workers`` DataLoader workers each), several epochs long (``stream()`` crosses them). The
runs: local + hierarchical sync, remote + hierarchical sync, local + flat sync. Reported per
region: IO wait after the first batch (goal: at most 1% with local data), time to first batch,
bytes across regions (the proxies count what crossed them); per job: gradient-sync time per step
and rank, the leaders' cross-region hop, and cross-region gradient bytes per step (a ring
traffic model, see trainer/comm.py). Gradient traffic runs over loopback here: the WAN rehearsal
(``geoshard.wan``) is what puts it behind the same latencies.

    .venv/bin/python bench/multiregion_bench.py            # ~10 minutes on 2 cores
    .venv/bin/python bench/multiregion_bench.py --small    # smoke run, figures meaningless
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the test suite uses
sys.path.insert(0, str(ROOT / "bench"))
from netproxy import NetProxy  # noqa: E402
from servers import SeaweedS3  # noqa: E402

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
US, EU, AP = "us-east-1", "eu-west-1", "ap-southeast-1"
WEIGHTS = {US: 2, EU: 1, AP: 1}
RANKS = f"{US}:2,{EU}:1,{AP}:1"
ONE_WAY_MS = {frozenset((US, EU)): 38.0, frozenset((US, AP)): 110.0, frozenset((EU, AP)): 85.0}
READS_FROM = {US: EU, EU: AP, AP: US}  # the "remote" scenario: whose bucket each region reads


def make_split(data: Path, samples: int, sample_bytes: int, shard_samples: int) -> Path:
    root = data / f"split-{samples}x{sample_bytes}-{shard_samples}"
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        args = ["--samples", str(samples), "--sample-bytes", str(sample_bytes), "--shard-samples", str(shard_samples)]
        subprocess.run([GEOSHARD, "synth", str(root / "corpus"), *args], check=True, capture_output=True, timeout=1800)
        plan = root / "plan.toml"
        plan.write_text('[shards]\nbytes = "8MB"\n' + "".join(f"[regions.{r}]\nweight = {w}\n" for r, w in WEIGHTS.items()))
        sources = [str(p) for p in sorted((root / "corpus").glob("*.tar"))]
        cmd = [GEOSHARD, "split", *sources, "--plan", str(plan), "--out", str(root / "split"), "--json"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
        shutil.rmtree(root / "corpus")
        (root / ".complete").touch()
    return root / "split"


def bucket_plan(path: Path, endpoints: dict[str, str]) -> Path:
    lines = []
    for r, w in WEIGHTS.items():
        lines += [f"[regions.{r}]", f"weight = {w}", f'bucket = "s3://mr-{r}/train"', f'endpoint = "{endpoints[r]}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def sync(split: Path, server: SeaweedS3, env: dict[str, str], work: Path) -> None:
    plan = bucket_plan(work / "sync-plan.toml", dict.fromkeys(WEIGHTS, server.endpoint))
    r = subprocess.run(
        [GEOSHARD, "sync", str(split), "--plan", str(plan), "--create-buckets"], env=env, capture_output=True, text=True, check=False
    )
    if r.returncode:
        raise RuntimeError(f"sync failed: {r.stderr[-2000:]}")


def train(run: Path, plan: Path, args: argparse.Namespace, sync_mode: str, env: dict[str, str]) -> dict[str, Any]:
    shutil.rmtree(run, ignore_errors=True)
    cmd = [GEOSHARD, "train", "--plan", str(plan), "--regions", RANKS, "--out", str(run), "--steps", str(args.steps)]
    cmd += ["--batch-size", str(args.batch_size), "--num-workers", str(args.num_workers), "--hidden", str(args.hidden)]
    cmd += ["--sync", sync_mode, "--checkpoint-every", str(args.steps), "--backend", "gloo", "--no-allow-cross-region"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False, cwd=run.parent)
    (run.parent / f"{run.name}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"run {run} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    return dict(json.loads((run / "report.json").read_text()))


def scenario(name: str, split: Path, server: SeaweedS3, args: argparse.Namespace, work: Path, env: dict[str, str], sync_mode: str) -> dict:
    """One run with each region's bucket behind its own proxy; the proxies' byte counts."""
    proxies: dict[str, NetProxy] = {}
    try:
        for r in WEIGHTS:
            if name == "remote":
                latency, rate = ONE_WAY_MS[frozenset((r, READS_FROM[r]))] / 1000, args.cross_mbps * 1e6 / 8
            else:
                latency, rate = args.in_region_ms / 1000, None
            proxies[r] = NetProxy.to_url(server.endpoint, latency_s=latency, rate=rate).start()
        plan = bucket_plan(work / f"plan-{name}.toml", {r: p.endpoint for r, p in proxies.items()})
        t0 = time.monotonic()
        report = train(work / f"run-{name}-{sync_mode}", plan, args, sync_mode, env)
        seconds = time.monotonic() - t0
        link_bytes = {r: p.stats().bytes_up + p.stats().bytes_down for r, p in proxies.items()}
    finally:
        for p in proxies.values():
            p.stop()
    regions = {
        r: {
            "io_wait_share": g["io_wait_share"],
            "io_wait_share_after_first_batch": g["io_wait_share_after_first_batch"],
            "time_to_first_batch_s": g["time_to_first_batch_s"],
            "bytes_read": sum(g["tier_bytes"].values()),
            "cross_region_data_bytes": link_bytes[r] if name == "remote" else 0,
        }
        for r, g in report["regions"].items()
    }
    steps = report["steps"]
    epochs = steps * args.batch_size / report["regions"][US]["samples_per_epoch"] * 2
    return {
        "scenario": name,
        "sync": sync_mode,
        "seconds": round(seconds, 1),
        "loop_wall_s": report["breakdown"]["wall"]["seconds"] / report["world_size"],
        "epochs": round(epochs, 2),
        "io_wait_share": report["io_wait_share"],
        "io_wait_share_after_first_batch": report["io_wait_share_after_first_batch"],
        "regions": regions,
        "cross_region_data_bytes": sum(x["cross_region_data_bytes"] for x in regions.values()),
        "grad_sync_s_per_step": report["grad_sync_s_per_step"],
        "grad_sync_cross_s_per_step": report["grad_sync_cross_s_per_step"],
        "grad_sync_intra_s_per_step": report["grad_sync_intra_s_per_step"],
        "cross_region_grad_bytes_per_step": report["cross_region_grad_bytes_per_step"],
        "step_s_mean": report["breakdown"]["wall"]["seconds"] / report["world_size"] / steps,
        "loss_first": report["loss_first"],
        "loss_last": report["loss_last"],
    }


def print_table(results: dict[str, Any]) -> None:
    print("\nIO wait after the first batch, per region (goal with local data: <= 1%)")
    runs = results["runs"]
    print(f"{'run':<26}" + "".join(f"{r:>16}" for r in WEIGHTS) + f"{'cross-region data':>20}")
    for run in runs:
        cells = "".join(f"{run['regions'][r]['io_wait_share_after_first_batch']:>15.2%} " for r in WEIGHTS)
        print(f"{run['scenario'] + ', ' + run['sync']:<26}{cells}{run['cross_region_data_bytes'] / 1e6:>17.1f} MB")
    print(f"\n{'run':<26}{'1st batch (max)':>16}{'sync/step':>12}{'cross hop':>12}{'grad bytes/step':>18}{'step':>10}")
    for run in runs:
        ttfb = max(run["regions"][r]["time_to_first_batch_s"] for r in WEIGHTS)
        print(
            f"{run['scenario'] + ', ' + run['sync']:<26}{ttfb:>15.2f}s{run['grad_sync_s_per_step'] * 1000:>10.1f}ms"
            f"{run['grad_sync_cross_s_per_step'] * 1000:>10.1f}ms{run['cross_region_grad_bytes_per_step'] / 1e6:>15.1f} MB"
            f"{run['step_s_mean'] * 1000:>8.0f}ms"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data" / "multiregion")
    ap.add_argument("--samples", type=int, default=24_000, help="corpus samples (us-east-1 gets about half)")
    ap.add_argument("--sample-bytes", type=int, default=1000)
    ap.add_argument("--shard-samples", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (several epochs)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--in-region-ms", type=float, default=1.0, help="one-way latency to a region's own bucket")
    ap.add_argument("--cross-mbps", type=float, default=100.0, help="cap of each cross-region data link (Mbit/s)")
    ap.add_argument("--small", action="store_true", help="smoke run (figures meaningless)")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "multiregion_bench.json")
    args = ap.parse_args()
    if args.small:
        args.samples, args.steps, args.hidden = 6000, 30, 128
    args.data.mkdir(parents=True, exist_ok=True)
    split = make_split(args.data, args.samples, args.sample_bytes, args.shard_samples)
    work = Path(tempfile.mkdtemp(prefix="runs-", dir=args.data))
    results: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": []}
    results["config"].update(ranks=RANKS, one_way_ms={"-".join(sorted(k)): v for k, v in ONE_WAY_MS.items()}, reads_from=READS_FROM)
    try:
        with SeaweedS3(work / "weed") as server:
            env = {**os.environ, **server.env(endpoint=False)}
            sync(split, server, env, work)
            for name, mode in (("local", "hierarchical"), ("remote", "hierarchical"), ("local", "flat")):
                print(f"run: {name} data, {mode} sync ...", flush=True)
                results["runs"].append(scenario(name, split, server, args, work, env, mode))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    local = results["runs"][0]
    results["goals"] = {
        "io_wait_after_first_batch_local_max": max(local["regions"][r]["io_wait_share_after_first_batch"] for r in WEIGHTS),
        "io_wait_after_first_batch_local_goal": 0.01,
        "cross_region_data_bytes_local": local["cross_region_data_bytes"],
    }
    results["goals"]["met"] = results["goals"]["io_wait_after_first_batch_local_max"] <= 0.01
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=1))
    print(f"\nraw: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
