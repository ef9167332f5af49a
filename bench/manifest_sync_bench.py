"""Benchmark: a no-op re-sync of a version 2 region as it grows (issue 21: sync stays proportional).

A synthetic split of one region with N small shards (1 KiB, one sample, one chunk: what is
measured is the per-object bookkeeping, not bytes) and their chunk indexes is synced once into a
fresh prefix of a local SeaweedFS, then synced again: the re-sync must list, compare and upload
nothing. Its wall and CPU time (the ``geoshard`` process) per N show how the cost grows.

    .venv/bin/python bench/manifest_sync_bench.py --shards 1000 10000 30000

Results go to docs/benchmarks.md ("Manifests at scale").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the test suite uses
from manifest_bench import record, save  # noqa: E402 - beside this file
from servers import SeaweedS3  # noqa: E402

from geoshard.manifest import Manifest, RegionManifest, RegionSummary, ShardChunks, ShardEntry, chunkindex  # noqa: E402
from geoshard.util.fsutil import write_atomic  # noqa: E402
from geoshard.util.hashing import xxh3_128  # noqa: E402

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGION = "us-east-1"


def fake_split(out: Path, count: int) -> Path:
    """A split folder with one version 2 region of ``count`` 1 KiB shards and their chunk indexes."""
    rdir = out / REGION
    rdir.mkdir(parents=True)
    entries = []
    for i in range(count):
        data = hashlib.shake_256(f"{i}".encode()).digest(1024)
        sha, fast = hashlib.sha256(data).hexdigest(), xxh3_128(data)
        name = f"{i // 10000:05d}-{i % 10000:04d}-{sha[:12]}.tar"
        (rdir / name).write_bytes(data)
        chunks = ShardChunks(512 << 10, (1024,), (1,), (fast,))
        (rdir / chunkindex.index_name(name)).write_bytes(chunks.index())
        entries.append(ShardEntry(name, 1, 1024, sha, i // 10000, fast, chunks))
    rm = RegionManifest(REGION, "wds", 1, "bench", entries, 2)
    data = rm.to_json()
    write_atomic(rdir / "manifest.json", data)
    summary = RegionSummary(f"{REGION}/manifest.json", count, count, rm.bytes, hashlib.sha256(data).hexdigest())
    write_atomic(out / "manifest.json", Manifest(1, "bench", "wds", {}, "bench", "", {REGION: summary}, ()).to_json())
    return out


def sync(folder: Path, plan: Path, env: dict[str, str]) -> tuple[float, float, dict[str, object]]:
    """(wall s, CPU s of the geoshard process, its region report)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    argv = [GEOSHARD, "sync", str(folder), "--plan", str(plan), "--json"]
    done = subprocess.run(argv, check=True, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)["regions"][REGION]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[1000, 10000, 30000])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, SeaweedS3(Path(tmp) / "weed") as server:
        env = {**os.environ, **server.env(endpoint=False)}
        for k in SeaweedS3.UNSET_ENV:
            env.pop(k, None)
        bucket = server.make_bucket("bench")[5:]
        for n in args.shards:
            folder = fake_split(Path(tmp) / f"split-{n}", n)
            plan = Path(tmp) / f"plan-{n}.toml"
            plan.write_text(f'[regions.{REGION}]\nweight = 1\nbucket = "s3://{bucket}/n{n}"\nendpoint = "{server.endpoint}"\n')
            first = sync(folder, plan, env)
            again = sync(folder, plan, env)
            assert again[2]["uploaded"] == 0 and again[2]["skipped"] == n, again
            row = {"shards": n, "first_s": first[0], "noop_s": again[0], "noop_cpu_s": again[1]}
            record(rows, row, f"first sync {first[0]:7.1f} s; no-op re-sync {again[0]:6.2f} s (CPU {again[1]:.2f} s), 0 uploads")
    save(rows, args.json_out)


if __name__ == "__main__":
    main()
