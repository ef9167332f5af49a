"""Benchmark: opening a region manifest of 10^3 to 10^5 shards, in both formats, in fresh processes.

A synthetic region of 64 MB shards cut into 128 chunks each (the issue's shape: 512 KiB chunks) is
written in version 1 (chunk hashes inline, today's buckets) and version 2 (one entry per shard in
columns; the chunk hashes in ``<shard>.chunks`` beside each shard, not read at open). Each file is
opened with ``geoshard.manifest.read_region_manifest`` in a fresh interpreter that reports the
open time and its peak RSS (``ru_maxrss``, imports included) and the RSS after the imports alone.

    .venv/bin/python bench/manifest_bench.py                       # 10^3, 10^4, 10^5, both formats
    .venv/bin/python bench/manifest_bench.py --shards 1000 20000 --json-out m.json

Results go to docs/benchmarks.md ("Manifests at scale").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = 128
CHUNK_BYTES = 524800  # 512 KiB of whole samples, as the split cuts them
SAMPLES = 146  # per chunk
# VmHWM, not ru_maxrss: Linux carries the parent's peak into ru_maxrss across exec.
_PROBE = """
import re, sys, time
def hwm():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\\s+(\\d+)", f.read()).group(1)) / 1024
from geoshard.manifest import read_region_manifest
base = hwm()
t0, c0 = time.perf_counter(), time.process_time()
m = read_region_manifest(sys.argv[1])
took, cpu = time.perf_counter() - t0, time.process_time() - c0
assert len(m.shards) == int(sys.argv[2]), len(m.shards)
print(took, cpu, hwm(), base)
"""


def _shard(i: int, version: int) -> dict[str, object]:
    sha = hashlib.sha256(i.to_bytes(8, "little")).hexdigest()
    entry: dict[str, object] = {
        "path": f"{i // 1000:05d}-{i % 1000:04d}-{sha[:12]}.tar",
        "samples": CHUNKS * SAMPLES,
        "bytes": CHUNKS * CHUNK_BYTES,
        "sha256": sha,
        "group": i // 1000,
        "xxh3_128": sha[:32],
    }
    if version == 1:
        hexes = os.urandom(16 * CHUNKS).hex()
        entry["chunks"] = {
            "size": 512 << 10,
            "bytes": [CHUNK_BYTES] * CHUNKS,
            "samples": [SAMPLES] * CHUNKS,
            "xxh3_128": [hexes[j : j + 32] for j in range(0, len(hexes), 32)],
        }
    return entry


def write_synthetic(path: Path, shards: int, version: int) -> int:
    """A region manifest of ``shards`` shards in ``version``'s format at ``path``; its size.

    Version 1 is written a shard at a time (a 10^5-shard one is ~650 MB); version 2 through the
    model's own writer (``RegionManifest.to_json``)."""
    head = {"format": "wds", "generation": 1, "plan_sha256": "0" * 64, "region": "us-east-1"}
    total = {"samples": shards * CHUNKS * SAMPLES, "bytes": shards * CHUNKS * CHUNK_BYTES}
    if version == 2:
        from geoshard.manifest import RegionManifest, ShardEntry

        entries = [ShardEntry(**_shard(i, 2), chunk_index=hashlib.sha256(str(i).encode()).hexdigest()[:32]) for i in range(shards)]  # type: ignore[arg-type]
        path.write_bytes(RegionManifest(shards=entries, version=2, **head).to_json())  # type: ignore[arg-type]
        return path.stat().st_size
    with path.open("w") as f:
        f.write(json.dumps(head | total | {"version": 1})[:-1] + ', "shards": [\n')
        for i in range(shards):
            f.write(("" if i == 0 else ",\n") + json.dumps(_shard(i, 1), sort_keys=True))
        f.write("\n]}\n")
    return path.stat().st_size


def measure(path: Path, shards: int) -> dict[str, float]:
    """Open time (wall and CPU, s), peak RSS and RSS after the imports (MB) of one fresh
    interpreter opening ``path``: CPU time tells a loaded machine's wall time apart."""
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), str(shards)], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )
    if r.returncode:
        raise RuntimeError(f"opening {path} failed: {r.stderr[-2000:]}")
    took, cpu, peak, base = map(float, r.stdout.split())
    return {"open_s": took, "cpu_s": cpu, "peak_rss_mb": peak, "imports_rss_mb": base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--versions", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.shards:
            for v in args.versions:
                path = Path(tmp) / f"v{v}-{n}.json"
                size = write_synthetic(path, n, v)
                row = {"shards": n, "version": v, "file_mb": size / 1e6} | measure(path, n)
                path.unlink()
                line = f"v{v}  {row['file_mb']:8.1f} MB  open {row['open_s']:6.2f} s (CPU {row['cpu_s']:.2f} s)  "
                record(rows, row, line + f"peak RSS {row['peak_rss_mb']:6.0f} MB (imports {row['imports_rss_mb']:.0f} MB)")
    save(rows, args.json_out)


def record(rows: list[dict[str, float]], row: dict[str, float], line: str) -> None:
    """Keep a measured row and print it after its shard count."""
    rows.append(row)
    print(f"{int(row['shards']):>7,} shards  {line}", flush=True)


def save(rows: list[dict[str, float]], path: Path | None) -> None:
    if path:
        path.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
