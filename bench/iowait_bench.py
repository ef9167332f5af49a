"""Benchmark of the trainer's IO wait when its region's bucket sits behind a long, narrow link.

A real SeaweedFS S3 server on 127.0.0.1 holds one region's split (synthesized, ``geoshard split``,
``geoshard sync``). The bench region's plan has no local replica and no Alluxio: only ``bucket``
and ``endpoint``, which points at ``bench/netproxy.py`` in front of SeaweedFS (75 ms each way and
a bandwidth cap shared by every connection, like one link between two sites). Nothing writes
back, so every shard of every run crosses the link (the proxy's byte count shows it).

Each repetition runs ``python -m torch.distributed.run --nproc-per-node 2 -m geoshard.trainer``
(gloo, ``--num-workers`` DataLoader workers per rank, ``--hidden 4096``: ~0.25 s of compute per
step here) for a fixed number of steps, all within one epoch of each rank:

- ``local``: the same split as a local replica (the baseline; repetition 1 is also the
  calibration that measures the trainer's consumption rate, from which the cap is set to
  ``--cap-factor`` times it, unless ``--cap-mbps`` fixes it);
- ``direct``: the bucket on SeaweedFS without the proxy (what the S3 path costs without the link);
- ``link``: through the proxy, default prefetch (2 shards ahead per worker);
- ``link, no prefetch``: the same with ``--prefetch 0``.

Before the runs, with the link idle: a timed GET of each rank's first shard through the proxy
(a fresh client, so connection set-up included), and the same shards fetched all at once as the
trainer's workers do at start. Goals checked: IO wait after the first batch at most 1%, time to
first batch at most the first shard's fetch plus 1 s. Results print as a table and go to
``--json-out``; the median of ``--repeat`` runs is reported, the raw runs are in the JSON.

    .venv/bin/python bench/iowait_bench.py              # full run, ~9 minutes
    .venv/bin/python bench/iowait_bench.py --small      # smoke run of the script, ~2 minutes

The smoke run's figures mean nothing: its 40 steps end before the link has caught up with the
start-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the test suite uses
sys.path.insert(0, str(ROOT / "bench"))
from netproxy import NetProxy  # noqa: E402
from servers import SeaweedS3, free_ports  # noqa: E402

from geoshard.loaders.epoch import Layout, rank_plan  # noqa: E402
from geoshard.split.task import CHUNK_BYTES  # noqa: E402
from geoshard.trainer.record import StepRecord, read_steps  # noqa: E402

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGION = "us-east-1"
BUCKET = "iowait"
PREFIX = "train"
WORLD = 2
SHUFFLE_BUFFER = 1000  # the trainer's default --shuffle-buffer
LOOKAHEAD = 16  # RegionalLoader.stream() starts the next epoch's workers this many batches early
DEFAULT_PREFETCH = 2  # the trainer's default --prefetch
SPLIT_PLAN = """
[routing]
policy = "hash"
[shards]
bytes = {shard_bytes}
[regions.{region}]
weight = 1
"""

# -- data --------------------------------------------------------------------------------------


def make_split(data: Path, samples: int, sample_bytes: int, shard_samples: int) -> Path:
    """A split of one region (cached by its parameters) with ``shard_samples`` samples per shard."""
    root = data / f"split-{samples}x{sample_bytes}-{shard_samples}-chunks{CHUNK_BYTES >> 10}k"
    manifest = root / "split" / REGION / "manifest.json"
    # A split cached before chunk hashes existed is made again (the loader reads such shards whole).
    if not (root / ".complete").exists() or '"chunks"' not in manifest.read_text():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        corpus = root / "corpus"
        args = ["--samples", str(samples), "--sample-bytes", str(sample_bytes), "--shard-samples", str(shard_samples)]
        subprocess.run([GEOSHARD, "synth", str(corpus), *args], check=True, capture_output=True, timeout=1800)
        sources = [str(p) for p in sorted(corpus.glob("*.tar"))]
        # The split packs whole sources up to the target size: the largest source as the target keeps them 1:1.
        target = max(Path(p).stat().st_size for p in sources)
        (root / "plan.toml").write_text(SPLIT_PLAN.format(shard_bytes=target, region=REGION))
        out = root / "split"
        subprocess.run(
            [GEOSHARD, "split", *sources, "--plan", str(root / "plan.toml"), "--out", str(out), "--json"],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        shutil.rmtree(corpus)
        (root / ".complete").touch()
    return root / "split"


def split_shard_bytes(split: Path) -> int:
    """The shard size ``make_split`` made ``split`` with: a plan that syncs it must say the same."""
    return int(tomllib.loads((split.parent / "plan.toml").read_text())["shards"]["bytes"])


def region_plan(path: Path, *, local: Path | None = None, endpoint: str | None = None, shard_bytes: int | None = None) -> Path:
    lines = [] if shard_bytes is None else ["[shards]", f"bytes = {shard_bytes}"]
    lines += [f"[regions.{REGION}]", "weight = 1"]
    if local is not None:
        lines.append(f'local = "{local}"')
    if endpoint is not None:
        lines += [f'bucket = "s3://{BUCKET}/{PREFIX}"', f'endpoint = "{endpoint}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def worker_starts(shards: list[dict[str, Any]], batch_size: int, workers: int) -> list[dict[str, Any]]:
    """Per rank and DataLoader worker (epoch 0, seed 0): its shards in the order it first needs
    them, and how many of them its first batch needs (a worker whose range starts inside a shard
    has a first shuffle window over two)."""
    counts = [s["samples"] for s in shards]
    out = []
    for rank in range(WORLD):
        layout = Layout(rank=rank, world_size=WORLD, num_workers=workers, batch_size=batch_size, seed=0, shuffle_buffer=SHUFFLE_BUFFER)
        plan = rank_plan(counts, 0, layout)
        for worker in range(workers):
            ids, _ = plan.worker_stream(worker, layout, 0)
            order = list(dict.fromkeys(ids.tolist()))
            out.append({"rank": rank, "worker": worker, "order": order, "first_batch": len(set(ids[:batch_size].tolist()))})
    return out


# -- the link ----------------------------------------------------------------------------------


def s3_client(server: SeaweedS3, endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(retries={"max_attempts": 1, "mode": "standard"}, read_timeout=120),
    )


def timed_get(server: SeaweedS3, endpoint: str, path: str, attempts: int = 3) -> float:
    """One GET through a fresh client (so a fresh connection), body read to the end; a transient
    server error (SeaweedFS answers InternalError now and then under load) is tried again."""
    from botocore.exceptions import ClientError

    for attempt in range(attempts):
        client = s3_client(server, endpoint)
        try:
            t = time.perf_counter()
            body = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{path}")["Body"]
            with body:
                body.read()
            return time.perf_counter() - t
        except ClientError:
            if attempt == attempts - 1:
                raise
        finally:
            client.close()
    raise AssertionError("unreachable")


def timed_burst(server: SeaweedS3, endpoint: str, paths: list[str]) -> float:
    """The time until all of ``paths``, fetched at once, are in."""
    t = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(lambda p: timed_get(server, endpoint, p), paths))
    return time.perf_counter() - t


# -- training runs -----------------------------------------------------------------------------


def trainer_has_hidden() -> bool:
    out = subprocess.run([sys.executable, "-m", "geoshard.trainer", "--help"], capture_output=True, text=True, timeout=120, cwd="/")
    return "--hidden" in out.stdout


def train(run_dir: Path, plan: Path, args: argparse.Namespace, prefetch: int, env: dict[str, str], hidden: bool) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_ports(1)[0]), "-m", "geoshard.trainer", "--plan", str(plan), "--region", REGION]
    cmd += ["--steps", str(args.steps), "--out", str(run_dir), "--batch-size", str(args.batch_size), "--prefetch", str(prefetch)]
    cmd += ["--num-workers", str(args.num_workers), "--checkpoint-every", str(args.steps), "--seed", "0"]
    if hidden:
        cmd += ["--hidden", str(args.hidden)]
    # cwd outside the repository: python -m puts the cwd first on sys.path, and the repository's
    # geoshard/ folder would shadow the installed package (which adds geoshard.loaders and .trainer).
    r = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=1200, check=False)
    (run_dir / "torchrun.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0 or not (run_dir / "report.json").exists():
        raise RuntimeError(f"trainer run in {run_dir} failed with exit code {r.returncode}:\n{r.stderr[-3000:]}")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return json.loads((run_dir / "report.json").read_text())


def steps_of(run_dir: Path) -> list[list[StepRecord]]:
    return [read_steps(run_dir / f"steps-rank{r}.jsonl", r) for r in range(WORLD)]


def summarize_run(run_dir: Path, report: dict[str, Any], bytes_per_sample: float, link_bytes: int | None) -> dict[str, Any]:
    """The figures of one run from its report and step records."""
    steps = steps_of(run_dir)
    walls = {r["rank"]: r["wall_s"] for r in report["ranks"]}
    # Consumption after the first step (start-up excluded): samples/s of both ranks together.
    rate = sum(sum(x.samples for x in s[1:]) / (walls[r] - s[0].t) for r, s in enumerate(steps))
    step_s = statistics.median(x.step_s for s in steps for x in s[1:])
    tiers = {
        name: {k: t[k] for k in ("hits", "bytes", "misses", "errors", "verify_failures", "fetch_seconds_mean", "fetch_seconds_max")}
        for name, t in report["tiers"].items()
    }
    return {
        "io_wait_share": report["io_wait_share"],
        "io_wait_share_after_first_batch": report["io_wait_share_after_first_batch"],
        "time_to_first_batch_s": report["time_to_first_batch_s"],
        "time_to_first_batch_s_ranks": [r["time_to_first_batch_s"] for r in report["ranks"]],
        "data_wait_s_first_step": [s[0].data_wait_s for s in steps],
        "data_wait_s_after_first": [round(sum(x.data_wait_s for x in s[1:]), 4) for s in steps],
        "wall_s": max(walls.values()),
        "step_s_median": step_s,
        "samples_per_s": rate,
        "consumption_bytes_per_s": rate * bytes_per_sample,
        "tiers": tiers,
        "fetch_seconds_max": max((t["fetch_seconds_max"] for t in tiers.values()), default=0.0),
        "writebacks": report["writebacks"],
        "link_bytes_down": link_bytes,
        "loss_first": report.get("loss_first"),
        "loss_last": report.get("loss_last"),
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    return {k: statistics.median(r[k] for r in runs) for k in keys if all(r[k] is not None for r in runs)}


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data" / "iowait")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps per run (within one epoch per rank)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--num-workers", type=int, default=2, help="trainer --num-workers (DataLoader workers per rank)")
    ap.add_argument("--hidden", type=int, default=4096, help="trainer --hidden: the compute per step (4096: ~0.25 s here)")
    ap.add_argument("--samples", type=int, default=96_000, help="samples in the region (both ranks' epoch)")
    ap.add_argument("--sample-bytes", type=int, default=1000, help="image bytes per sample (a sample is ~3.5 KB in its shard)")
    ap.add_argument("--shard-samples", type=int, default=2000, help="samples per shard (2000: ~7 MB shards)")
    ap.add_argument("--latency-ms", type=float, default=75.0, help="one-way latency of the link")
    ap.add_argument("--cap-factor", type=float, default=1.5, help="link cap as a multiple of the measured consumption rate")
    ap.add_argument("--cap-mbps", type=float, help="fix the cap (Mbit/s) instead of calibrating it")
    ap.add_argument(
        "--only-link", action="store_true", help="only the local (calibration) and link runs: without the direct and no-prefetch baselines"
    )
    ap.add_argument("--small", action="store_true", help="smoke run of the script (figures meaningless): 40 steps, 1 repetition")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "iowait_bench.json")
    args = ap.parse_args()
    if args.small:
        args.samples, args.steps, args.repeat = 24_000, 40, 1
    per_rank_batches = math.ceil(args.samples // WORLD / args.batch_size)
    if args.steps + LOOKAHEAD + 2 > per_rank_batches:
        ap.error(
            f"--steps {args.steps} would reach the end of the epoch ({per_rank_batches} batches per rank, the next epoch's "
            f"workers start {LOOKAHEAD} before); raise --samples"
        )
    args.data.mkdir(parents=True, exist_ok=True)
    split = make_split(args.data, args.samples, args.sample_bytes, args.shard_samples)
    manifest = json.loads((split / REGION / "manifest.json").read_text())
    shards = manifest["shards"]
    bytes_per_sample = manifest["bytes"] / manifest["samples"]
    shard_mb = statistics.median(s["bytes"] for s in shards) / 1e6
    hidden = trainer_has_hidden()
    if not hidden:
        print("warning: this trainer has no --hidden; running its default model", file=sys.stderr)
    print(
        f"region {REGION}: {manifest['samples']:,} samples, {len(shards)} shards of ~{shard_mb:.1f} MB ({bytes_per_sample:.0f} B/sample); "
        f"{WORLD} ranks x {args.num_workers} workers, batch {args.batch_size}, hidden {args.hidden if hidden else 'default'}, "
        f"{args.steps} steps"
    )

    results: dict[str, Any] = {
        "config": {
            "region_samples": manifest["samples"],
            "region_bytes": manifest["bytes"],
            "shards": len(shards),
            "shard_bytes_median": statistics.median(s["bytes"] for s in shards),
            "bytes_per_sample": bytes_per_sample,
            "world_size": WORLD,
            "num_workers": args.num_workers,
            "batch_size": args.batch_size,
            "hidden": args.hidden if hidden else None,
            "steps": args.steps,
            "batches_per_rank_per_epoch": per_rank_batches,
            "latency_ms_each_way": args.latency_ms,
            "cap_factor": args.cap_factor,
            "repeat": args.repeat,
        },
        "runs": {"local": [], "link": []} if args.only_link else {"local": [], "direct": [], "link": [], "link, no prefetch": []},
    }
    runs_dir = args.data / f"runs-{args.json_out.stem}"  # one folder per --json-out: its plans and runs
    runs_dir.mkdir(parents=True, exist_ok=True)
    # A server folder of its own: two benches running at once must not delete each other's data.
    weed_root = Path(tempfile.mkdtemp(prefix="weed-", dir=args.data))
    try:
        with SeaweedS3(weed_root) as server:
            run_all(args, server, split, runs_dir, hidden, results)
    finally:
        shutil.rmtree(weed_root, ignore_errors=True)

    results["median"] = {name: median_of(rs) for name, rs in results["runs"].items()}
    results["goals"] = goals(results)
    print_table(results)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=1))
    print(f"raw runs: {args.json_out}; run folders: {runs_dir}")
    return 0


def bucket_env(server: SeaweedS3) -> dict[str, str]:
    """This environment with the server's credentials and no default endpoint (plans name theirs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env.update(server.env(endpoint=False))
    for k in SeaweedS3.UNSET_ENV:
        env.pop(k, None)
    return env


def run_all(args: argparse.Namespace, server: SeaweedS3, split: Path, runs_dir: Path, hidden: bool, results: dict[str, Any]) -> None:
    """Publish the split to the server, calibrate the link, then every repetition of every run."""
    env = bucket_env(server)
    server.make_bucket(BUCKET)
    sync_plan = region_plan(runs_dir / "plan-sync.toml", endpoint=server.endpoint, shard_bytes=split_shard_bytes(split))
    subprocess.run([GEOSHARD, "sync", str(split), "--plan", str(sync_plan)], check=True, env=env, capture_output=True, timeout=1800)
    shards = json.loads((split / REGION / "manifest.json").read_text())["shards"]
    bytes_per_sample = results["config"]["bytes_per_sample"]
    local_plan = region_plan(runs_dir / "plan-local.toml", local=split / REGION)
    direct_plan = region_plan(runs_dir / "plan-direct.toml", endpoint=server.endpoint)
    proxy: NetProxy | None = None
    try:
        for rep in range(args.repeat):
            print(f"repetition {rep + 1}/{args.repeat}: local replica", flush=True)
            rd = runs_dir / f"local-{rep}"
            load = os.getloadavg()[0]
            rep_local = summarize_run(rd, train(rd, local_plan, args, DEFAULT_PREFETCH, env, hidden), bytes_per_sample, None)
            rep_local["loadavg_1m"] = [load, os.getloadavg()[0]]
            results["runs"]["local"].append(rep_local)
            if proxy is None:
                # Calibration: the cap from the first local run's consumption rate.
                consumption = rep_local["consumption_bytes_per_s"]
                cap = args.cap_mbps * 1e6 / 8 if args.cap_mbps else args.cap_factor * consumption
                results["calibration"] = {"consumption_bytes_per_s": consumption, "cap_bytes_per_s": cap, "cap_mbit_s": cap * 8 / 1e6}
                print(
                    f"  consumption {consumption / 1e6:.2f} MB/s (both ranks) -> link cap {cap / 1e6:.2f} MB/s "
                    f"({cap * 8 / 1e6:.0f} Mbit/s, {cap / consumption:.2f}x), {args.latency_ms:.0f} ms each way",
                    flush=True,
                )
                proxy = NetProxy.to_url(server.endpoint, latency_s=args.latency_ms / 1e3, rate=cap).start()
                results["first_shard"] = fs = measure_first_fetch(server, proxy.endpoint, shards, args.batch_size, args.num_workers)
                print(
                    f"  idle link: first shard GET {fs['get_s']:.2f} s; "
                    f"start-up burst {fs['burst_prefetch_s']:.2f} s ({fs['burst_prefetch_shards']} shards at once), "
                    f"{fs['burst_no_prefetch_s']:.2f} s ({fs['burst_no_prefetch_shards']} shards) without prefetch",
                    flush=True,
                )
            link_plan = region_plan(runs_dir / "plan-link.toml", endpoint=proxy.endpoint)
            for name, plan, depth in (
                ("direct", direct_plan, DEFAULT_PREFETCH),
                ("link", link_plan, DEFAULT_PREFETCH),
                ("link, no prefetch", link_plan, 0),
            ):
                if name not in results["runs"]:
                    continue
                print(f"repetition {rep + 1}/{args.repeat}: {name}", flush=True)
                rd = runs_dir / f"{name.replace(', ', '-').replace(' ', '-')}-{rep}"
                before, load = proxy.stats().bytes_down, os.getloadavg()[0]
                report = train(rd, plan, args, depth, env, hidden)
                link_bytes = proxy.stats().bytes_down - before if plan is link_plan else None
                run = summarize_run(rd, report, bytes_per_sample, link_bytes)
                # Other processes on this machine change the trainer's speed, and with it the cap's margin.
                run["loadavg_1m"] = [load, os.getloadavg()[0]]
                if plan is link_plan:
                    run["cap_over_consumption"] = results["calibration"]["cap_bytes_per_s"] / run["consumption_bytes_per_s"]
                results["runs"][name].append(run)
            for name, rs in results["runs"].items():
                r = rs[-1]
                print(
                    f"  {name:18} io wait {r['io_wait_share']:.2%}, after first batch {r['io_wait_share_after_first_batch']:.2%}, "
                    f"first batch {r['time_to_first_batch_s']:.2f} s, step {r['step_s_median'] * 1e3:.0f} ms, "
                    f"load {r['loadavg_1m'][0]:.1f}-{r['loadavg_1m'][1]:.1f}",
                    flush=True,
                )
    finally:
        if proxy is not None:
            proxy.stop()


def measure_first_fetch(server: SeaweedS3, endpoint: str, shards: list[dict[str, Any]], batch_size: int, workers: int) -> dict[str, Any]:
    """Idle-link fetch times: each rank's first shard(s) alone (median of 3), and the start-up bursts."""
    starts = worker_starts(shards, batch_size, workers)
    # A rank's first batch comes from its worker 0; its shards are fetched one after the other here.
    firsts = [[shards[i] for i in w["order"][: w["first_batch"]]] for w in starts if w["worker"] == 0]
    per_rank = [statistics.median(sum(timed_get(server, endpoint, s["path"]) for s in need) for _ in range(3)) for need in firsts]
    # What the workers ask for at once when they start: max(prefetch, 1) shards each (prefetch threads).
    burst = [shards[i]["path"] for w in starts for i in w["order"][:DEFAULT_PREFETCH]]
    burst0 = [shards[w["order"][0]]["path"] for w in starts]
    return {
        "first_batch_shards": {f"rank {w['rank']} worker {w['worker']}": w["first_batch"] for w in starts},
        "first_shard_bytes": [sum(s["bytes"] for s in need) for need in firsts],
        "get_s_ranks": per_rank,
        "get_s": max(per_rank),  # the report's time to first batch is the slower rank's
        "burst_prefetch_shards": len(burst),
        "burst_prefetch_s": statistics.median(timed_burst(server, endpoint, burst) for _ in range(2)),
        "burst_no_prefetch_shards": len(burst0),
        "burst_no_prefetch_s": statistics.median(timed_burst(server, endpoint, burst0) for _ in range(2)),
    }


def goals(results: dict[str, Any]) -> dict[str, Any]:
    fetch = results["first_shard"]["get_s"]
    out = {}
    for name in ("link", "link, no prefetch"):
        if name not in results["median"]:
            continue
        m = results["median"][name]
        out[name] = {
            "io_wait_after_first_batch_le_1pct": m["io_wait_share_after_first_batch"] <= 0.01,
            "ttfb_le_first_shard_get_plus_1s": m["time_to_first_batch_s"] <= fetch + 1.0,
            "ttfb_minus_first_shard_get_s": m["time_to_first_batch_s"] - fetch,
            "ttfb_le_in_run_fetch_max_plus_1s": m["time_to_first_batch_s"] <= m["fetch_seconds_max"] + 1.0,
        }
    base = results["median"]["local"]["io_wait_share_after_first_batch"]
    link = results["median"]["link"]["io_wait_share_after_first_batch"]
    out["link_minus_local_after_first_batch_points"] = (link - base) * 100
    if "link, no prefetch" in results["median"]:
        no_prefetch = results["median"]["link, no prefetch"]["io_wait_share_after_first_batch"]
        out["no_prefetch_over_prefetch_after_first_batch"] = no_prefetch / max(link, 1e-9)
    return out


def print_table(results: dict[str, Any]) -> None:
    cal, fs = results["calibration"], results["first_shard"]
    print()
    print(
        f"link: {results['config']['latency_ms_each_way']:.0f} ms each way, cap {cal['cap_bytes_per_s'] / 1e6:.2f} MB/s "
        f"({cal['cap_mbit_s']:.0f} Mbit/s) = {cal['cap_bytes_per_s'] / cal['consumption_bytes_per_s']:.2f}x the consumption "
        f"of {cal['consumption_bytes_per_s'] / 1e6:.2f} MB/s; first shard GET on the idle link {fs['get_s']:.2f} s"
    )
    print(
        "| run | IO wait | after first batch | time to first batch | TTFB - first shard GET | step | samples/s "
        "| requests | MB fetched | fetch mean / max | link MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rs in results["runs"].items():
        m = results["median"][name]
        hits = statistics.median(sum(t["hits"] for t in r["tiers"].values()) for r in rs)
        mb = statistics.median(sum(t["bytes"] for t in r["tiers"].values()) for r in rs) / 1e6
        mean = statistics.median(max((t["fetch_seconds_mean"] for t in r["tiers"].values()), default=0.0) for r in rs)
        on_link = "link_bytes_down" in m
        link = f"{m['link_bytes_down'] / 1e6:.0f}" if on_link else "-"
        over = f"{m['time_to_first_batch_s'] - fs['get_s']:+.2f} s" if on_link else "-"
        print(
            f"| {name} | {m['io_wait_share']:.2%} | {m['io_wait_share_after_first_batch']:.2%} | {m['time_to_first_batch_s']:.2f} s "
            f"| {over} | {m['step_s_median'] * 1e3:.0f} ms | {m['samples_per_s']:,.0f} "
            f"| {hits:.0f} | {mb:.0f} | {mean:.2f} / {m['fetch_seconds_max']:.2f} s | {link} |"
        )
    g = results["goals"]
    for name in ("link", "link, no prefetch"):
        if name not in g:
            continue
        print(
            f"{name}: IO wait after first batch <= 1%: {'met' if g[name]['io_wait_after_first_batch_le_1pct'] else 'NOT met'}; "
            f"time to first batch <= first shard GET + 1 s: {'met' if g[name]['ttfb_le_first_shard_get_plus_1s'] else 'NOT met'} "
            f"({g[name]['ttfb_minus_first_shard_get_s']:+.2f} s)"
        )
    print(
        f"link - local after first batch: {g['link_minus_local_after_first_batch_points']:+.2f} points; "
        f"no prefetch / prefetch: {g.get('no_prefetch_over_prefetch_after_first_batch', float('nan')):.1f}x; "
        f"cap / consumption in the link runs: {results['median']['link']['cap_over_consumption']:.2f}x (median)"
    )


if __name__ == "__main__":
    sys.exit(main())
