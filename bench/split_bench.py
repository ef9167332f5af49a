"""Benchmark of ``geoshard split`` against ``cp -r`` of the same corpus, in the same run.

Two corpora (WebDataset tar, three members per sample): ~1 GB of 100 KB samples, and 200,000
samples of 1 KB. For each, the median of ``--repeat`` runs of:

- ``cp -r CORPUS COPY`` (the I/O baseline: one read and one write of every byte),
- ``geoshard split CORPUS --plan PLAN --out OUT --json`` (3 regions, 2:1:1, 64 MB shards,
  by default on Dask's threaded scheduler with a thread per core, for local sources), timed end
  to end as a user sees it, with the cluster start and the task time taken from its JSON; with
  ``--processes`` also the same split on an in-process cluster of one worker process per core,
- webdataset 1.0.2's own reader over the first shards of the 1 KB corpus (a per-sample peer).

It also measures hash throughput in the same run: the split hashes every source with xxh3-128
(recorded in the top manifest) and every shard with sha256, xxh3-128 and one xxh3-128 per chunk
in the same pass as it writes it (all recorded in the region manifests), which bounds how close to
``cp`` it can get on this many cores; the table also gives the bound of the former design, which
hashed sources with sha256 too. Results print as a table and go to ``--json-out``.

    .venv/bin/python bench/split_bench.py            # full size (~2 GB of test data in bench/_data)
    .venv/bin/python bench/split_bench.py --small    # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
PLAN = """
[routing]
policy = "hash"
[shards]
bytes = "64MB"
[regions.us-east-1]
weight = 2
[regions.eu-west-1]
weight = 1
[regions.ap-southeast-1]
weight = 1
"""


def corpus(data: Path, name: str, samples: int, sample_bytes: int, shard_samples: int) -> Path:
    path = data / name
    stamp = path / ".complete"
    if not stamp.exists():
        shutil.rmtree(path, ignore_errors=True)
        args = ["synth", str(path), "--samples", str(samples), "--sample-bytes", str(sample_bytes), "--shard-samples", str(shard_samples)]
        subprocess.run([GEOSHARD, *args], check=True, timeout=1800, capture_output=True)
        stamp.touch()
    return path


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.tar"))


def warm(path: Path) -> None:
    """Read every file once so both contenders start from the page cache."""
    for p in sorted(path.rglob("*.tar")):
        with open(p, "rb") as f:
            while f.read(1 << 22):
                pass


def timed(argv: list[str]) -> tuple[float, str, float]:
    """Wall seconds, stdout, and the CPU seconds (user + system) the command and its children used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=1800).stdout
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, out, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bench_cp(src: Path, scratch: Path) -> float:
    dst = scratch / "cp-copy"
    shutil.rmtree(dst, ignore_errors=True)
    seconds, _, _ = timed(["cp", "-r", str(src), str(dst)])
    shutil.rmtree(dst)
    return seconds


def bench_split(src: Path, plan: Path, scratch: Path, *extra: str) -> tuple[float, dict[str, float]]:
    out = scratch / "split-out"
    shutil.rmtree(out, ignore_errors=True)
    seconds, stdout, cpu = timed([GEOSHARD, "split", str(src), "--plan", str(plan), "--out", str(out), "--json", *extra])
    doc = json.loads(stdout)
    doc["cpu_seconds"] = cpu  # the whole command's, workers included
    doc["seconds_wall"] = seconds
    doc["groups"] = len({s["group"] for s in json.loads((out / "manifest.json").read_text())["sources"]})
    shutil.rmtree(out)
    return seconds, doc


def bench_webdataset(src: Path, shards: int) -> tuple[float, int]:
    code = (
        "import sys, time, warnings, webdataset as wds\n"
        "warnings.simplefilter('ignore')\n"
        "urls = sys.argv[1:]\n"
        "t = time.perf_counter(); n = sum(1 for _ in wds.WebDataset(urls, shardshuffle=False, empty_check=False))\n"
        "print(n, time.perf_counter() - t)\n"
    )
    urls = [str(p) for p in sorted(src.glob("*.tar"))[:shards]]
    out = subprocess.run([sys.executable, "-c", code, *urls], check=True, capture_output=True, text=True, timeout=1800).stdout.split()
    return float(out[1]), int(out[0])


def hash_rate(algorithm: str) -> float:
    from geoshard.util import hashing

    block = os.urandom(1 << 20)
    h = hashing.new(algorithm)
    t = time.perf_counter()
    for _ in range(512):
        h.update(block)
    return 512 * len(block) / (time.perf_counter() - t)


# What a split on each path imports: the CLI with its split command, progress bar and table, and
# Dask's threaded scheduler (the default, local sources); and distributed as well (--processes,
# --scheduler, s3:// sources).
THREADED_IMPORTS = "import geoshard.cli, geoshard.cli.progress, geoshard.split.job, geoshard.split.threaded"
CLUSTER_IMPORTS = "import geoshard.cli, geoshard.cli.progress, geoshard.split.job, geoshard.split.cluster"


def import_seconds(statement: str = THREADED_IMPORTS, repeat: int = 3) -> tuple[float, float]:
    """Wall and CPU seconds of a Python that only imports what a split needs and exits: the fixed
    cost no split on that path can avoid on this machine, measured in the same run (medians)."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, _, cpu = timed([sys.executable, "-P", "-c", statement])
        walls.append(wall)
        cpus.append(cpu)
    return statistics.median(walls), statistics.median(cpus)


def bare_python_seconds(repeat: int = 3) -> float:
    """Wall time of ``python -P -c pass``: the interpreter's own start and exit."""
    return import_seconds("pass", repeat)[0]


def projection(cp_s: float, doc: dict, imports_cpu: float, cores: int) -> dict[str, float]:  # type: ignore[type-arg]
    """A PROJECTION, not a measurement: the ratio to ``cp -r`` this run's split would reach on N
    cores, N in (2, 4, 8, 16). What ran outside the tasks (Python, imports, listing, the routing
    table, publishing: the wall time minus ``job_seconds``) stays as measured here; the tasks'
    CPU (the command's CPU minus that of starting Python with the same imports; the driver's own
    few CPU-ms stay in it) spreads over N cores but over no more cores than there are groups
    (one task per group). ``cp -r`` is one process and stays as measured. It assumes the tasks
    scale with cores (their reads, writes and hashes release the GIL; per-sample Python does
    not) and that memory bandwidth and the disk keep up."""
    serial = doc["seconds_wall"] - doc["job_seconds"]
    task_cpu = max(doc["cpu_seconds"] - imports_cpu, 0.0)
    out = {"serial_seconds": serial, "task_cpu_seconds": task_cpu}
    for n in (2, 4, 8, 16):
        out[f"ratio_on_{n}_cores"] = cp_s / (serial + task_cpu / min(n, doc["groups"]))
    return out


def profile_tasks(src: Path, plan: Path, groups: int) -> None:
    """cProfile of the split's task (``run_group``) over the first ``groups`` groups, in this process
    and after one warm-up group (imports, page cache): where a task's CPU time goes."""
    import cProfile
    import pstats
    import tempfile

    from geoshard.plan import load_plan
    from geoshard.plan.routing import RouteSpec
    from geoshard.split.groups import make_groups
    from geoshard.split.sources import S3Access, expand_sources
    from geoshard.split.task import GroupTask, run_group

    p = load_plan(plan)
    refs = expand_sources([str(src)])
    made = make_groups(refs, p)
    route = RouteSpec(p, refs[0].format)
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:

        def task(gid: int) -> GroupTask:
            out = Path(tmp) / str(gid)
            return GroupTask(
                gid, made[gid], refs[0].format, route, p.region_names, p.shards.bytes, p.shards.samples, None, str(out), S3Access()
            )

        run_group(task(len(made) - 1))
        size = sum(r.size for g in made[:groups] for r in g)
        prof = cProfile.Profile()
        t, c = time.perf_counter(), time.process_time()
        prof.enable()
        for gid in range(groups):
            run_group(task(gid))
        prof.disable()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
    rate, load = cpu / size * 1e9, os.getloadavg()[0]
    print(f"{groups} group(s), {size / 1e6:.0f} MB: {wall:.2f} s wall, {cpu:.2f} s CPU = {rate:.2f} CPU-s per GB (load {load:.1f})")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def _median_run(walls: list[float], docs: list[dict]) -> dict:  # type: ignore[type-arg]
    return sorted(zip(walls, docs, strict=True), key=lambda pair: pair[0])[len(walls) // 2][1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny corpora, for a smoke run")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "split_bench.json")
    ap.add_argument("--only", choices=("100KB", "1KB"), help="one corpus only")
    ap.add_argument("--profile-groups", type=int, metavar="N", help="instead: cProfile the split's task over N groups of each corpus")
    ap.add_argument("--processes", action="store_true", help="also time the split on worker processes (--processes), alternating")
    args = ap.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    scratch = args.data / "scratch"
    scratch.mkdir(exist_ok=True)
    plan = args.data / "plan.toml"
    plan.write_text(PLAN)
    scale = 20 if args.small else 1
    specs = [
        ("100KB", 10_000 // scale, 100_000, 500 // scale),
        ("1KB", 200_000 // scale, 1_000, 10_000 // scale),
    ]
    cores = len(os.sched_getaffinity(0))
    sha, fast = hash_rate("sha256"), hash_rate("xxh3_128")
    bare, (imports, imports_cpu), (cluster_imports, _) = bare_python_seconds(), import_seconds(), import_seconds(CLUSTER_IMPORTS)
    results = {
        "cores": cores,
        "sha256_bytes_per_s": sha,
        "xxh3_128_bytes_per_s": fast,
        "python_seconds": bare,
        "import_seconds": imports,  # the default (threaded) path's imports, with Python's start and exit
        "import_cpu_seconds": imports_cpu,
        "cluster_import_seconds": cluster_imports,  # the same with distributed (--processes, --scheduler)
        "loadavg_start": os.getloadavg()[0],
        "corpora": {},
    }
    print(f"{cores} cores; per core, 1 MiB updates: sha256 {sha / 1e9:.2f} GB/s, xxh3-128 {fast / 1e9:.2f} GB/s")
    print(
        f"Python start and exit {bare:.2f} s; with the threaded split's imports {imports:.2f} s; "
        f"with distributed's (--processes) {cluster_imports:.2f} s (load {os.getloadavg()[0]:.1f})"
    )
    header = (
        f"{'corpus':8} {'samples':>8} {'MB':>7} | {'cp s':>6} {'cp MB/s':>8} | {'split s':>7} {'MB/s':>6} {'samples/s':>10} {'ratio':>6} | "
        f"{'cluster s':>9} {'tasks s':>7} {'task samples/s':>14}"
    )
    print(header)
    print("-" * len(header))
    for name, samples, sample_bytes, shard_samples in specs:
        if args.only and name != args.only:
            continue
        src = corpus(args.data, f"corpus-{name}-{samples}", samples, sample_bytes, shard_samples)
        size = tree_bytes(src)
        warm(src)
        if args.profile_groups:
            profile_tasks(src, plan, args.profile_groups)
            continue
        bench_cp(src, scratch)  # warm the page cache for writes as well
        cps, splits, docs, psplits, pdocs = [], [], [], [], []
        load_before = os.getloadavg()[0]
        for _ in range(args.repeat):
            cps.append(bench_cp(src, scratch))
            s, doc = bench_split(src, plan, scratch)
            splits.append(s)
            docs.append(doc)
            if args.processes:
                s, doc = bench_split(src, plan, scratch, "--processes")
                psplits.append(s)
                pdocs.append(doc)
        cp_s, split_s = statistics.median(cps), statistics.median(splits)
        job_s = statistics.median(d["job_seconds"] for d in docs)
        cluster_s = statistics.median(d["cluster_seconds"] for d in docs)
        row = {
            "samples": samples,
            "bytes": size,
            "cp_seconds": cp_s,
            "split_seconds": split_s,
            "split_cluster_seconds": cluster_s,
            "split_task_seconds": job_s,
            "cp_mb_per_s": size / cp_s / 1e6,
            "split_mb_per_s": size / split_s / 1e6,
            "split_samples_per_s": samples / split_s,
            "task_samples_per_s": samples / job_s,
            "ratio_to_cp": cp_s / split_s,
            "task_ratio_to_cp": cp_s / job_s,
            # Hashing as the split does (sources: xxh3-128; shards: sha256, xxh3-128 and chunk
            # xxh3-128s) on all cores, with nothing else: the best time possible; and the same for
            # the former design (sources by sha256 as well).
            "hash_floor_seconds": (1 / sha + 3 / fast) * size / cores,
            "ratio_ceiling_from_hashing": cp_s / ((1 / sha + 3 / fast) * size / cores),
            "ratio_ceiling_sources_sha256": cp_s / ((2 / sha + 2 / fast) * size / cores),
            # ... and with the fixed cost of starting Python with the CLI and Dask imported.
            "ratio_ceiling_with_imports": cp_s / ((1 / sha + 3 / fast) * size / cores + imports),
            "cluster_kind": docs[0].get("cluster", "processes"),  # where the default split's tasks ran
            "groups": docs[0]["groups"],  # tasks: one per group
            # The task CPU per GB (the command's CPU minus a bare start with the same imports), and
            # what it projects on more cores, from the run with the median wall time.
            "task_cpu_s_per_gb": statistics.median(max(d["cpu_seconds"] - imports_cpu, 0.0) for d in docs) / size * 1e9,
            "projection": projection(cp_s, _median_run(splits, docs), imports_cpu, cores),
            # Python start, imports and exit: the wall time outside the split's own clock.
            "outside_seconds": statistics.median(w - d["seconds"] for w, d in zip(splits, docs, strict=True)),
            "runs": {
                "cp": cps,
                "split": splits,
                "cluster": [d["cluster_seconds"] for d in docs],
                "tasks": [d["job_seconds"] for d in docs],
                "cpu": [d["cpu_seconds"] for d in docs],
            },
            "loadavg": [load_before, os.getloadavg()[0]],  # 1-minute load average before and after (other work on the machine)
        }
        if psplits:
            p_s = statistics.median(psplits)
            row["processes"] = {
                "split_seconds": p_s,
                "ratio_to_cp": cp_s / p_s,
                "split_cluster_seconds": statistics.median(d["cluster_seconds"] for d in pdocs),
                "split_task_seconds": statistics.median(d["job_seconds"] for d in pdocs),
                "task_ratio_to_cp": cp_s / statistics.median(d["job_seconds"] for d in pdocs),
                "runs": {
                    "split": psplits,
                    "cluster": [d["cluster_seconds"] for d in pdocs],
                    "tasks": [d["job_seconds"] for d in pdocs],
                    "cpu": [d["cpu_seconds"] for d in pdocs],
                },
            }
        if name == "1KB":
            wds_s, wds_n = bench_webdataset(src, shards=2)
            row["webdataset_samples_per_s"] = wds_n / wds_s
        results["corpora"][name] = row
        print(
            f"{name:8} {samples:>8,} {size / 1e6:>7.0f} | {cp_s:>6.2f} {row['cp_mb_per_s']:>8.0f} | "
            f"{split_s:>7.2f} {row['split_mb_per_s']:>6.0f} {row['split_samples_per_s']:>10,.0f} {row['ratio_to_cp']:>6.2f} | "
            f"{cluster_s:>9.2f} {job_s:>7.2f} {row['task_samples_per_s']:>14,.0f}   load {load_before:.1f}-{os.getloadavg()[0]:.1f}"
        )
        if psplits:
            pr = row["processes"]
            print(
                f"{'  procs':8} {'':>8} {'':>7} | {'':>6} {'':>8} | {pr['split_seconds']:>7.2f} {size / pr['split_seconds'] / 1e6:>6.0f} "
                f"{samples / pr['split_seconds']:>10,.0f} {pr['ratio_to_cp']:>6.2f} | {pr['split_cluster_seconds']:>9.2f} "
                f"{pr['split_task_seconds']:>7.2f} {samples / pr['split_task_seconds']:>14,.0f}"
            )
    for name, row in results["corpora"].items():
        print(
            f"{name}: hashing sources and shards alone needs {row['hash_floor_seconds']:.2f} s on {cores} cores, "
            f"so the ratio to cp cannot exceed {row['ratio_ceiling_from_hashing']:.2f} here "
            f"({row['ratio_ceiling_sources_sha256']:.2f} when sources were hashed with sha256 too); "
            f"with Python and its imports ({imports:.2f} s) not above {row['ratio_ceiling_with_imports']:.2f}"
        )
        pj = row["projection"]
        print(
            f"{name}: tasks {row['task_cpu_s_per_gb']:.2f} CPU-s per GB in {row['groups']} groups; PROJECTED (not measured) ratio to cp "
            + ", ".join(f"{pj[f'ratio_on_{n}_cores']:.2f} on {n} cores" for n in (2, 4, 8, 16))
            + f" (outside the tasks {pj['serial_seconds']:.2f} s as measured; tasks {pj['task_cpu_seconds']:.2f} CPU-s over the cores)"
        )
        if "webdataset_samples_per_s" in row:
            print(
                f"{name}: webdataset 1.0.2 reads {row['webdataset_samples_per_s']:,.0f} samples/s of this corpus (read only, one process)"
            )
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
