"""Benchmark of ``geoshard sync`` over a long link, against raw s5cmd and a boto3 loop.

A real SeaweedFS S3 server on 127.0.0.1 sits behind ``bench/netproxy.py`` adding 75 ms each way
(this kernel has no netem). In one run, for each file set (500 shards of 1 MB, 16 of 64 MB), the
median of ``--repeat`` uploads into fresh prefixes by:

- ``geoshard sync DIR --plan PLAN`` (the CLI, end to end: list, compare, verify, upload, check,
  publish the manifest),
- ``s5cmd cp 'DIR/region/*' s3://bucket/raw-N/`` (the same binary, no bookkeeping),
- a sequential boto3 ``put_object`` loop (what a hand-written script does).

Then a no-op re-sync of a 10,000-shard region through the same link (zero uploads expected).

    .venv/bin/python bench/sync_bench.py                # full run
    .venv/bin/python bench/sync_bench.py --small        # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the test suite uses
from servers import SeaweedS3  # noqa: E402

from geoshard.manifest import Manifest, RegionManifest, RegionSummary, ShardEntry  # noqa: E402
from geoshard.plan import parse_plan  # noqa: E402
from geoshard.sync.s5cmd import resolve_binary  # noqa: E402
from geoshard.util.fsutil import write_atomic  # noqa: E402

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGION = "us-east-1"


def fake_split(out: Path, count: int, size: int, seed: int) -> Path:
    """A split folder with one region of ``count`` random shards of ``size`` bytes."""
    if (out / "manifest.json").exists():
        return out
    rdir = out / REGION
    rdir.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(count):
        data = hashlib.shake_256(f"{seed}-{i}".encode()).digest(size) if size <= 4096 else os.urandom(size)
        sha = hashlib.sha256(data).hexdigest()
        name = f"00000-{i:05d}-{sha[:12]}.tar"
        (rdir / name).write_bytes(data)
        entries.append(ShardEntry(name, 1, size, sha, 0))
    rm = RegionManifest(REGION, "wds", 1, "bench", tuple(entries))
    write_atomic(rdir / "manifest.json", rm.to_json())
    summary = RegionSummary(f"{REGION}/manifest.json", len(entries), len(entries), rm.bytes, hashlib.sha256(rm.to_json()).hexdigest())
    plan = parse_plan(f"[regions.{REGION}]\nweight = 1\n")  # plan_for's layout: sync checks the split was made with it
    top = Manifest(1, "bench", "wds", plan.to_dict(), "bench", plan.layout_sha256(), {REGION: summary}, ())
    write_atomic(out / "manifest.json", top.to_json())
    return out


def plan_for(path: Path, bucket: str, prefix: str, endpoint: str) -> Path:
    path.write_text(f'[regions.{REGION}]\nweight = 1\nbucket = "s3://{bucket}/{prefix}"\nendpoint = "{endpoint}"\n')
    return path


def timed(argv: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, env=env, capture_output=True, timeout=3600)
    return time.perf_counter() - t


BOTO_LOOP = """
import sys, time, boto3, pathlib
endpoint, bucket, prefix, folder = sys.argv[1:5]
c = boto3.client("s3", endpoint_url=endpoint)
files = sorted(p for p in pathlib.Path(folder).glob("*.tar"))
t = time.perf_counter()
for p in files:
    c.put_object(Bucket=bucket, Key=f"{prefix}/{p.name}", Body=p.read_bytes())
print(time.perf_counter() - t)
"""


def start_proxy(target: str, latency_ms: float) -> tuple[subprocess.Popen[str], str]:
    host_port = target.removeprefix("http://")
    argv = [
        sys.executable,
        "-u",
        str(ROOT / "bench" / "netproxy.py"),
        "--listen",
        "127.0.0.1:0",
        "--target",
        host_port,
        "--latency-ms",
        str(latency_ms),
    ]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    endpoint = next(w for w in line.split() if w.startswith("http://") or w.count(":") == 1)
    return p, endpoint if endpoint.startswith("http://") else f"http://{endpoint}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data" / "sync")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=75.0)
    ap.add_argument("--boto3-repeat", type=int, default=1, help="runs of the (slow) boto3 loop per set")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "sync_bench.json")
    args = ap.parse_args()
    scale = 10 if args.small else 1
    sets = {"500x1MB": (500 // scale, 10**6), "16x64MB": (16 // (2 if args.small else 1), 64 * 10**6 // scale)}
    results: dict[str, Any] = {"latency_ms_each_way": args.latency_ms, "sets": {}}
    with SeaweedS3(args.data / "weed") as server:
        env = {**os.environ, **server.env(endpoint=False)}
        for k in SeaweedS3.UNSET_ENV:
            env.pop(k, None)
        proxy, link = start_proxy(server.endpoint, args.latency_ms)
        try:
            print(f"SeaweedFS {server.endpoint}, link {link} with {args.latency_ms:.0f} ms each way")
            bucket = server.make_bucket("bench")[5:]
            s5 = resolve_binary()
            for name, (count, size) in sets.items():
                folder = fake_split(args.data / f"split-{name}", count, size, seed=1)
                runs: dict[str, list[float]] = {"geoshard sync": [], "s5cmd cp": [], "boto3 loop": []}
                for rep in range(args.repeat):
                    prefix = f"{name}-{rep}-{time.time_ns()}"
                    plan = plan_for(args.data / "plan.toml", bucket, f"{prefix}/gs", link)
                    runs["geoshard sync"].append(timed([GEOSHARD, "sync", str(folder), "--plan", str(plan)], env))
                    glob = str(folder / REGION / "*.tar")
                    runs["s5cmd cp"].append(
                        timed([s5, "--endpoint-url", link, "--numworkers", "64", "cp", glob, f"s3://{bucket}/{prefix}/raw/"], env)
                    )
                    if rep >= args.boto3_repeat:
                        continue
                    out = subprocess.run(
                        [sys.executable, "-c", BOTO_LOOP, link, bucket, f"{prefix}/boto", str(folder / REGION)],
                        check=True,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=3600,
                    ).stdout
                    runs["boto3 loop"].append(float(out.strip()))
                med = {k: statistics.median(v) for k, v in runs.items() if v}
                total = count * size
                results["sets"][name] = {
                    "objects": count,
                    "bytes": total,
                    "runs": runs,
                    "median_s": med,
                    "sync_vs_s5cmd": med["geoshard sync"] / med["s5cmd cp"],
                    "boto3_vs_sync": med["boto3 loop"] / med["geoshard sync"] if "boto3 loop" in med else None,
                }
                print(
                    f"{name}: "
                    + ", ".join(f"{k} {v:.2f} s ({total / v / 1e6:.0f} MB/s)" for k, v in med.items())
                    + f"; sync/s5cmd {med['geoshard sync'] / med['s5cmd cp']:.2f}x"
                    + (f"; boto3/sync {med['boto3 loop'] / med['geoshard sync']:.1f}x" if "boto3 loop" in med else "")
                )
            # No-op re-sync of a 10,000-shard region: upload once directly, then re-sync through the link.
            n = 1000 if args.small else 10_000
            folder = fake_split(args.data / f"split-noop-{n}", n, 1024, seed=2)
            plan_direct = plan_for(args.data / "plan-direct.toml", bucket, f"noop-{n}", server.endpoint)
            timed([GEOSHARD, "sync", str(folder), "--plan", str(plan_direct)], env)
            plan_link = plan_for(args.data / "plan-link.toml", bucket, f"noop-{n}", link)
            noop = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                doc = json.loads(
                    subprocess.run(
                        [GEOSHARD, "sync", str(folder), "--plan", str(plan_link), "--json"],
                        check=True,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600,
                    ).stdout
                )
                noop.append(time.perf_counter() - t)
                assert doc["regions"][REGION]["uploaded"] == 0 and doc["regions"][REGION]["skipped"] == n, doc
            results["noop_resync"] = {"shards": n, "runs": noop, "median_s": statistics.median(noop)}
            print(f"no-op re-sync of {n:,} shards through the link: {statistics.median(noop):.2f} s (zero uploads)")
        finally:
            proxy.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proxy.wait(5)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=1))
    shutil.rmtree(args.data / "weed", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
