"""Benchmark: sync, pull, verify and refresh of a version 2 region as it grows (issue 21: they stay
proportional to the shard count; a no-op re-run lists and compares, nothing more).

A synthetic split of one region with N tiny shards (a valid 2 KiB tar of one sample each, one
chunk, its chunk index beside it: what is measured is the per-shard bookkeeping, not bytes) is
published into a fresh prefix of a local SeaweedFS and then, each as a ``geoshard`` process:

- ``sync`` (first) and ``sync`` again: the no-op re-sync must upload nothing;
- ``pull`` into an empty replica (first) and ``pull`` again: the no-op pull fetches nothing and
  reads nothing (each shard and index found by the stat recorded when it verified);
- ``verify`` of the replica: each entry's shard size, xxh3_128, sample count and chunk index;
- ``refresh`` with its sources unchanged (run twice: the first records the sources' stat, the
  one measured finds them by it): no source byte read, no split, a no-op sync.

Each no-op's data bytes read or moved are counted from its report and printed: the re-sync's
shard bytes hashed locally and uploaded, the pull's bytes re-hashed and downloaded, the
refresh's source bytes hashed and uploaded. All must be 0; verify reads every byte by design.

The baseline, measured in the same run, is the process's start (``geoshard --version``); each
step's per-shard cost is its slope between the sizes, so a constant slope is proportional growth.

    .venv/bin/python bench/manifest_sync_bench.py --shards 1000 10000 30000

Results go to docs/benchmarks.md ("Manifests at scale").
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the test suite uses
from manifest_bench import save  # noqa: E402 - beside this file
from servers import SeaweedS3  # noqa: E402

from geoshard.manifest import (  # noqa: E402
    Manifest,
    RegionManifest,
    RegionSummary,
    ShardChunks,
    ShardEntry,
    SourceEntry,
    chunkindex,
    read_region_manifest,
)
from geoshard.plan import load_plan  # noqa: E402
from geoshard.split.sources import expand_sources  # noqa: E402
from geoshard.util.fsutil import write_atomic  # noqa: E402
from geoshard.util.hashing import xxh3_128  # noqa: E402

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGION = "us-east-1"
PER_GROUP = 10_000  # shards per group (the name's part has 4 digits)
STEPS = ("sync", "resync", "pull", "repull", "verify", "refresh")


def tiny_tar(key: str) -> bytes:
    """One WebDataset sample (``key.bin``, 100 bytes) as a whole tar: 2 KiB with its end blocks."""
    body = key.encode().ljust(100, b".")
    info = tarfile.TarInfo(f"{key}.bin")
    info.size, info.mtime = len(body), 0
    return info.tobuf(tarfile.USTAR_FORMAT) + body.ljust(512, b"\0") + bytes(1024)


def fake_split(out: Path, sources: Path, count: int, plan_path: Path) -> Path:
    """A split folder with one version 2 region of ``count`` tiny shards and their chunk indexes,
    made as from one tiny source per group in ``sources`` (so ``refresh`` finds them unchanged)."""
    rdir = out / REGION
    rdir.mkdir(parents=True)
    sources.mkdir()
    groups = (count + PER_GROUP - 1) // PER_GROUP
    for g in range(groups):
        (sources / f"src-{g:05d}.tar").write_bytes(tiny_tar(f"source-{g}"))
    entries = []
    for i in range(count):
        data = tiny_tar(f"s{i:08d}")
        sha, fast = hashlib.sha256(data).hexdigest(), xxh3_128(data)
        name = f"{i // PER_GROUP:05d}-{i % PER_GROUP:04d}-{sha[:12]}.tar"
        (rdir / name).write_bytes(data)
        chunks = ShardChunks(512 << 10, (len(data),), (1,), (fast,))
        (rdir / chunkindex.index_name(name)).write_bytes(chunks.index())
        entries.append(ShardEntry(name, 1, len(data), sha, i // PER_GROUP, fast, chunks))
    plan = load_plan(plan_path)
    rm = RegionManifest(REGION, "wds", 1, plan.sha256(), entries, 2)
    data = rm.to_json()
    write_atomic(rdir / "manifest.json", data)
    summary = RegionSummary(f"{REGION}/manifest.json", count, count, rm.bytes, hashlib.sha256(data).hexdigest())
    refs = expand_sources([str(sources)])
    srcs = tuple(SourceEntry(r.url, r.size, "", g, xxh3_128(Path(r.url).read_bytes())) for g, r in enumerate(refs))
    top = Manifest(1, "bench", "wds", plan.to_dict(), plan.sha256(), plan.layout_sha256(), {REGION: summary}, srcs)
    write_atomic(out / "manifest.json", top.to_json())
    return out


def run(argv: list[str], env: dict[str, str], code: int = 0) -> tuple[float, float, str]:
    """(wall s, CPU s of the process and what it waited for, its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([GEOSHARD, *argv], env=env, capture_output=True, text=True, timeout=3600, check=False)
    wall = time.perf_counter() - t
    if done.returncode != code:
        raise RuntimeError(f"geoshard {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def one_size(tmp: Path, n: int, bucket: str, server: SeaweedS3, env: dict[str, str]) -> dict[str, float]:
    plan = tmp / f"plan-{n}.toml"
    plan.write_text(f'[regions.{REGION}]\nweight = 1\nbucket = "s3://{bucket}/n{n}"\nendpoint = "{server.endpoint}"\n')
    folder, sources, replica = fake_split(tmp / f"split-{n}", tmp / f"src-{n}", n, plan), tmp / f"src-{n}", tmp / f"replica-{n}"
    pull = ["pull", "--plan", str(plan), "--region", REGION, "--to", str(replica), "--json"]
    got: dict[str, tuple[float, float, str]] = {
        "sync": run(["sync", str(folder), "--plan", str(plan), "--json"], env),
        "resync": run(["sync", str(folder), "--plan", str(plan), "--json"], env),
        "pull": run(pull, env),
        "repull": run(pull, env),
        "verify": run(["verify", str(replica), "--json"], env),
    }
    refresh = ["refresh", str(sources), "--plan", str(plan), "--out", str(folder), "--json"]
    run(refresh, env)  # records the sources' stat (a folder split before this version has none)
    got["refresh"] = run(refresh, env)
    resync = json.loads(got["resync"][2])["regions"][REGION]
    assert resync["uploaded"] == 0 and resync["skipped"] == n, resync
    repull = json.loads(got["repull"][2])
    assert (repull["downloaded"], repull["skipped"], repull["indexes_downloaded"], repull["indexes_skipped"]) == (0, n, 0, n), repull
    verified = json.loads(got["verify"][2])
    assert verified["checked"] == n and not verified["missing"] and not verified["mismatched"], verified
    refreshed = json.loads(got["refresh"][2])
    assert refreshed["split"]["unchanged"] and refreshed["sync"]["regions"][REGION]["uploaded"] == 0, refreshed
    rsync = refreshed["sync"]["regions"][REGION]
    row: dict[str, float] = {
        "shards": n,
        "resync_bytes": resync["bytes_read_locally"] + resync["bytes_uploaded"],
        "repull_bytes": repull["bytes_rehashed"] + repull["bytes_downloaded"],
        "repull_stat_matched": repull["stat_matched"],
        "refresh_bytes": refreshed["split"]["source_bytes_hashed"] + rsync["bytes_read_locally"] + rsync["bytes_uploaded"],
        "refresh_split_s": refreshed["split"]["seconds"],
        "refresh_sync_s": rsync["seconds"],
        "resync_sync_s": resync["seconds"],
        "verify_bytes": sum(s.bytes for s in read_region_manifest(replica).shards),
    }
    for step, (wall, cpu, _) in got.items():
        row[f"{step}_s"], row[f"{step}_cpu_s"] = wall, cpu
    return row


def slopes(rows: list[dict[str, float]]) -> list[str]:
    """Per-shard CPU and wall (ms) of each step between consecutive sizes."""
    lines = []
    for a, b in itertools.pairwise(rows):
        d = b["shards"] - a["shards"]
        parts = [f"{s} {1e3 * (b[f'{s}_cpu_s'] - a[f'{s}_cpu_s']) / d:.3f}/{1e3 * (b[f'{s}_s'] - a[f'{s}_s']) / d:.3f}" for s in STEPS]
        lines.append(f"{int(a['shards']):,} -> {int(b['shards']):,} shards, ms a shard (CPU/wall): " + ", ".join(parts))
    return lines


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
        base = run(["--version"], env)
        print(f"baseline (geoshard --version): {base[0]:.2f} s wall, {base[1]:.2f} s CPU; load {os.getloadavg()[0]:.1f}", flush=True)
        for n in sorted(args.shards):
            row = one_size(Path(tmp), n, bucket, server, env) | {"start_s": base[0], "start_cpu_s": base[1], "load": os.getloadavg()[0]}
            rows.append(row)
            cells = "  ".join(f"{s} {row[f'{s}_s']:.2f} s (CPU {row[f'{s}_cpu_s']:.2f})" for s in STEPS)
            print(f"{n:>7,} shards  {cells}  load {row['load']:.1f}", flush=True)
            moved = "  ".join(f"{s} {int(row[f'{s}_bytes']):,}" for s in ("resync", "repull", "refresh", "verify"))
            found = int(row["repull_stat_matched"])
            print(f"{n:>7,} shards  data bytes read or moved: {moved} (pull found {found:,} files by stat)", flush=True)
            print(
                f"{n:>7,} shards  refresh: split check {row['refresh_split_s']:.2f} s, sync {row['refresh_sync_s']:.2f} s; "
                f"re-sync's sync {row['resync_sync_s']:.2f} s",
                flush=True,
            )
    for line in slopes(rows):
        print(line)
    save(rows, args.json_out)


if __name__ == "__main__":
    main()
