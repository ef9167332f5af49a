"""Benchmark of local-replica read throughput: ``geoshard.loaders.RegionalDataset`` next to its peers
on the same samples, in the same run.

No decoding, page cache warm, the consumer only counts samples and the bytes of one field. Two
corpora of synthetic WebDataset samples (three fields: ``img``, ``cls``, ``json``): 2,000 samples
of 100 KB and 40,000 of 1 KB. Each is made with ``geoshard synth``, split with ``geoshard split``
for one region (``eu-west-1``, 64 MB compact ustar shards) whose ``local`` is the split folder,
and written again with ``litdata.optimize`` (64 MB chunks) from the split's own shards, so every
reader serves the same samples. Readers, each in its own process (so its peak RSS is its own):

- ``cat`` of the split's shards to /dev/null (the I/O baseline; MB/s of tar bytes);
- LitData 0.2.76 ``StreamingDataset`` (fields come out as memoryviews of its mmapped chunks), and
  the same with each field turned into ``bytes`` by the consumer (what the other readers hand out);
- webdataset 1.0.2 ``WebDataset`` over the split's shards (``shardshuffle=False``, no decoding);
- ``RegionalDataset(plan, "eu-west-1", shuffle=False)``: default ``ChainSettings`` (every shard's
  sha256 checked against the manifest) and ``ChainSettings(verify="size")``;
- through a DataLoader with 2 workers and batches of 64: ``make_loader(...)`` (batches collated in
  the workers) for both settings, a torch ``DataLoader`` over ``WebDataset``, and LitData's
  ``StreamingDataLoader`` (with a collate that turns its memoryviews into bytes: they do not pickle).

Each reader reads its corpus once to warm up, then up to ``--repeat`` timed epochs (fewer past
``--budget`` seconds), in ``--passes`` passes over all readers; the best epoch counts, so a burst of
other work on the machine spoils a run, not the result. A DataLoader epoch includes starting its
workers. It also measures sha256 per core in the same run: verifying every shard bounds what the
default settings can reach on this many cores. Results print as tables and go to ``--json-out``.

    .venv/bin/python bench/loader_bench.py            # full size, ~2 minutes once the corpora exist (~0.6 GB in bench/_data)
    .venv/bin/python bench/loader_bench.py --quick --passes 1   # small corpora, a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGION = "eu-west-1"
PREFETCH = 2  # RegionalDataset's default
BATCH = 64
WORKERS = 2
RSS_BASE_MB = 300  # the goal's budget: 300 MB plus prefetch x shard size
READERS = (
    "cat",
    "litdata",
    "litdata-bytes",
    "webdataset",
    "geoshard-sha256",
    "geoshard-size",
    "litdata-dl",
    "webdataset-dl",
    "geoshard-sha256-dl",
    "geoshard-size-dl",
)
LABELS = {
    "cat": "cat (tar bytes)",
    "litdata": "LitData StreamingDataset (memoryviews)",
    "litdata-bytes": "LitData, fields as bytes",
    "webdataset": "webdataset WebDataset",
    "geoshard-sha256": "RegionalDataset, verify=sha256",
    "geoshard-size": "RegionalDataset, verify=size",
    "litdata-dl": "LitData StreamingDataLoader",
    "webdataset-dl": "WebDataset in a DataLoader",
    "geoshard-sha256-dl": "make_loader, verify=sha256",
    "geoshard-size-dl": "make_loader, verify=size",
}
SINGLE = {
    "litdata-dl": "litdata-bytes",
    "webdataset-dl": "webdataset",
    "geoshard-sha256-dl": "geoshard-sha256",
    "geoshard-size-dl": "geoshard-size",
}


# -- corpora --------------------------------------------------------------------------------------
def run(argv: list[str], timeout: float = 1800) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode:
        raise SystemExit(f"{' '.join(argv[:3])} ... failed with exit code {r.returncode}:\n{r.stderr[-2000:]}")
    return r.stdout


def region_shards(corpus: Path) -> list[Path]:
    from geoshard.manifest import read_region_manifest

    folder = corpus / "split" / REGION
    return [folder / s.path for s in read_region_manifest(folder).shards]


def litdata_samples(path: str) -> Iterable[dict[str, Any]]:
    """One split shard's samples as dicts, for ``litdata.optimize`` (top level: its workers import it)."""
    from geoshard.formats import wds

    with open(path, "rb") as f:
        for key, members in wds.iter_samples(f, path):
            yield {"__key__": key.decode(), **wds.sample_fields(members)}


def corpus(data: Path, name: str, samples: int, sample_bytes: int, shard_bytes: str) -> Path:
    path = data / f"loader-{name}-{samples}-{shard_bytes}"
    stamp = path / ".complete"
    if stamp.exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    sizes = f"--samples {samples} --sample-bytes {sample_bytes} --shard-samples {samples}".split()
    run([GEOSHARD, "synth", str(path / "src"), *sizes])  # one source file: the split cuts it into shards of the plan's size
    plan = path / "plan.toml"
    plan.write_text(f'[shards]\nbytes = "{shard_bytes}"\n\n[regions.{REGION}]\nweight = 1\nlocal = "{path / "split" / REGION}"\n')
    run([GEOSHARD, "split", str(path / "src"), "--plan", str(plan), "--out", str(path / "split"), "--json"])
    shutil.rmtree(path / "src")  # the split holds the same samples
    # LitData's own format, written from the split's shards so that both hold the same samples in the same order.
    code = (
        "import sys, litdata\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from loader_bench import litdata_samples\n"
        "if __name__ == '__main__':\n"
        f"    litdata.optimize(fn=litdata_samples, inputs=sys.argv[2:], output_dir=sys.argv[1], chunk_bytes={shard_bytes!r}, "
        "num_workers=1, mode='overwrite')\n"
    )
    script = path / "optimize.py"
    script.write_text(code)
    run([sys.executable, str(script), str(path / "litdata"), *map(str, region_shards(path))])
    script.unlink()
    meta = corpus_meta(path)
    (path / "corpus.json").write_text(json.dumps(meta, indent=1))
    stamp.touch()
    return path


def corpus_meta(path: Path) -> dict[str, Any]:
    """Samples and bytes of the corpus as geoshard's own member-by-member reader sees them."""
    from geoshard.formats import wds
    from geoshard.manifest import read_region_manifest

    shards = region_shards(path)
    samples = payload = img = 0
    for p in shards:
        with open(p, "rb") as f:
            for _, members in wds.iter_samples(f, str(p)):
                fields = wds.sample_fields(members)
                samples += 1
                payload += sum(map(len, fields.values()))
                img += len(fields["img"])
    manifest = read_region_manifest(path / "split" / REGION)
    return {
        "samples": samples,
        "payload_bytes": payload,
        "img_bytes": img,
        "tar_bytes": sum(p.stat().st_size for p in shards),
        "shards": len(shards),
        "max_shard_bytes": max(s.bytes for s in manifest.shards),
        "litdata_bytes": sum(p.stat().st_size for p in (path / "litdata").iterdir()),
    }


def warm(path: Path) -> None:
    """Read every file once so that all readers start from the page cache."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 22):
                    pass


# -- readers (each runs in a process of its own) ---------------------------------------------------
def hwm_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def children_maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KB on Linux


# Each counter returns (samples, bytes of the img field, seconds to the first item, samples in it).
Count = tuple[int, int, float, int]


def count_samples(items: Iterable[Any]) -> Count:
    t0 = time.perf_counter()
    n = b = 0
    first = 0.0
    for s in items:
        if not n:
            first = time.perf_counter() - t0
        n += 1
        b += len(s["img"])
    return n, b, first, 1


def count_as_bytes(items: Iterable[Any]) -> Count:
    """As ``count_samples``, turning every memoryview field into bytes first."""
    t0 = time.perf_counter()
    n = b = 0
    first = 0.0
    for s in items:
        if not n:
            first = time.perf_counter() - t0
        for v in s.values():
            if v.__class__ is memoryview:
                v.tobytes()
        n += 1
        b += len(bytes(s["img"]))
    return n, b, first, 1


def count_batches(batches: Iterable[Any]) -> Count:
    t0 = time.perf_counter()
    n = b = first_n = 0
    first = 0.0
    for batch in batches:
        if not n:
            first, first_n = time.perf_counter() - t0, len(batch["__key__"])
        n += len(batch["__key__"])
        b += sum(map(len, batch["img"]))
    return n, b, first, first_n


def bytes_collate(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """LitData's samples into a batch of lists of bytes (its memoryviews neither collate nor pickle)."""
    return {k: [s[k].tobytes() if s[k].__class__ is memoryview else s[k] for s in samples] for k in samples[0]}


def make_reader(name: str, corpus: Path) -> Callable[[], Count]:
    shards = [str(p) for p in region_shards(corpus)]
    plan = corpus / "plan.toml"
    if name == "cat":
        cat = shutil.which("cat") or "cat"

        def read_cat() -> Count:
            subprocess.run([cat, *shards], stdout=subprocess.DEVNULL, check=True, timeout=600)
            return -1, -1, 0.0, 0

        return read_cat
    if name.startswith("litdata"):
        from litdata import StreamingDataLoader, StreamingDataset

        lds = StreamingDataset(str(corpus / "litdata"))
        if name == "litdata":
            return lambda: count_samples(lds)
        if name == "litdata-bytes":
            return lambda: count_as_bytes(lds)
        dl = StreamingDataLoader(lds, batch_size=BATCH, num_workers=WORKERS, collate_fn=bytes_collate)
        return lambda: count_batches(dl)
    if name.startswith("webdataset"):
        import webdataset as wds

        warnings.simplefilter("ignore")
        wdset = wds.WebDataset(shards, shardshuffle=False, empty_check=False)
        if name == "webdataset":
            return lambda: count_samples(wdset)
        from torch.utils.data import DataLoader

        wdl = DataLoader(wdset, batch_size=BATCH, num_workers=WORKERS)
        return lambda: count_batches(wdl)
    from geoshard.loaders import ChainSettings, RegionalDataset, make_loader

    settings = ChainSettings(verify="size" if "-size" in name else "sha256")
    if name.endswith("-dl"):
        loader = make_loader(plan, REGION, batch_size=BATCH, num_workers=WORKERS, shuffle=False, prefetch=PREFETCH, settings=settings)
        return lambda: count_batches(loader)
    ds = RegionalDataset(plan, REGION, shuffle=False, prefetch=PREFETCH, settings=settings)
    return lambda: count_samples(ds)


def reader_main(name: str, corpus: Path, repeat: int, budget: float) -> None:
    read = make_reader(name, corpus)
    t0 = time.perf_counter()
    n, b, _, _ = read()  # warm-up: imports inside the readers, worker start-up code, page cache
    warm_s = time.perf_counter() - t0
    runs: list[float] = []
    firsts: list[float] = []
    while len(runs) < repeat and (not runs or sum(runs) + min(runs) <= budget):
        t = time.perf_counter()
        got_n, got_b, first_s, _ = read()
        runs.append(time.perf_counter() - t)
        firsts.append(first_s)
        if (got_n, got_b) != (n, b):
            raise SystemExit(f"{name}: epoch gave {(got_n, got_b)} (samples, img bytes), the warm-up gave {(n, b)}")
    out = {
        "samples": n,
        "img_bytes": b,
        "runs": runs,
        "first_item_s": firsts,
        "warmup_s": warm_s,
        "rss_mb": hwm_mb(),
        "children_rss_mb": children_maxrss_mb(),
        "loadavg": os.getloadavg()[0],
    }
    print(json.dumps(out))


def measure(name: str, corpus: Path, repeat: int, budget: float) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--reader", name, "--corpus", str(corpus), "--repeat", str(repeat)]
    out = run([*argv, "--budget", str(budget)], timeout=1800)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


# -- the report ------------------------------------------------------------------------------------
def sha256_rate() -> float:
    block = os.urandom(1 << 20)
    best = 0.0
    for _ in range(3):
        h = hashlib.sha256()
        t = time.perf_counter()
        for _ in range(128):
            h.update(block)
        best = max(best, 128 * len(block) / (time.perf_counter() - t))
    return best


def summarize(name: str, meta: dict[str, Any], raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    r = raw[name]
    best = min(r["runs"])
    if name == "cat":
        sps, mbps = meta["samples"] / best, meta["tar_bytes"] / best / 1e6
    else:
        if (r["samples"], r["img_bytes"]) != (meta["samples"], meta["img_bytes"]):
            raise SystemExit(
                f"{name} read {r['samples']} samples / {r['img_bytes']} img bytes, the corpus has {meta['samples']} / {meta['img_bytes']}"
            )
        sps, mbps = meta["samples"] / best, meta["payload_bytes"] / best / 1e6
    row = {
        "reader": name,
        "label": LABELS[name],
        "best_s": best,
        "samples_per_s": sps,
        "mb_per_s": mbps,
        "first_item_best_s": min(r["first_item_s"]),
        **r,
    }
    return row


def report(name: str, meta: dict[str, Any], rows: dict[str, dict[str, Any]], budget_mb: float) -> None:
    lit, cat = rows["litdata"]["samples_per_s"], rows["cat"]["samples_per_s"]
    print(
        f"\n{name}: {meta['samples']:,} samples, {meta['payload_bytes'] / 1e6:,.0f} MB of fields, {meta['tar_bytes'] / 1e6:,.0f} MB in "
        f"{meta['shards']} shards (largest {meta['max_shard_bytes'] / 1e6:.0f} MB); RSS budget {budget_mb:.0f} MiB per process"
    )
    header = f"{'reader':40} {'samples/s':>10} {'MB/s':>7} {'/LitData':>8} {'/cat':>6} {'DL/single':>9} {'1st item':>8} {'RSS MiB':>7}"
    header += f" {'workers':>7}"
    print(header)
    print("-" * len(header))
    for key, row in rows.items():
        row["vs_litdata"] = row["samples_per_s"] / lit
        row["vs_cat"] = row["samples_per_s"] / cat
        single = rows.get(SINGLE.get(key, ""))
        row["dataloader_vs_single"] = row["samples_per_s"] / single["samples_per_s"] if single else None
        row["rss_budget_mb"] = budget_mb
        row["peak_rss_mb"] = max(row["rss_mb"], row["children_rss_mb"]) if key.endswith("-dl") else row["rss_mb"]
        workers = f"{row['children_rss_mb']:>7.0f}" if key.endswith("-dl") else " " * 7
        dl = f"{row['dataloader_vs_single']:>9.2f}" if single else " " * 9
        first = f"{row['first_item_best_s'] * 1e3:>6.0f}ms" if key != "cat" else " " * 8
        print(
            f"{row['label']:40} {row['samples_per_s']:>10,.0f} {row['mb_per_s']:>7,.0f} {row['vs_litdata']:>8.2f} "
            f"{row['vs_cat']:>6.2f} {dl} {first} {row['rss_mb']:>7.0f} {workers}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data")
    ap.add_argument("--repeat", type=int, default=3, help="timed epochs per reader and pass, at most")
    ap.add_argument("--budget", type=float, default=5.0, help="seconds of timed epochs per reader and pass before it stops repeating")
    ap.add_argument("--passes", type=int, default=2, help="passes over all readers (a burst of load elsewhere then spoils one, not all)")
    ap.add_argument("--quick", action="store_true", help="small corpora and 4 MB shards, for a smoke run")
    ap.add_argument(
        "--readers", default=",".join(READERS), help="comma-separated subset (cat and litdata are always run: the ratios need them)"
    )
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        reader_main(args.reader, args.corpus, args.repeat, args.budget)
        return 0
    if importlib.util.find_spec("litdata") is None:
        print("loader_bench: LitData is the peer to beat: .venv/bin/pip install litdata==0.2.76 torch==2.13.0", file=sys.stderr)
        return 2
    readers = [r for r in READERS if r in {"cat", "litdata", *args.readers.split(",")}]
    shard_bytes = "4MB" if args.quick else "64MB"
    scale = 10 if args.quick else 1
    specs = [("100KB", 2_000 // scale, 100_000), ("1KB", 40_000 // scale, 1_000)]
    json_out = args.json_out or args.data / ("loader_bench_quick.json" if args.quick else "loader_bench.json")
    args.data.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    sha = sha256_rate()
    import torch

    results: dict[str, Any] = {
        "cores": cores,
        "sha256_bytes_per_s": sha,
        "torch": torch.__version__,
        "shard_bytes": shard_bytes,
        "prefetch": PREFETCH,
        "batch_size": BATCH,
        "num_workers": WORKERS,
        "loadavg_start": os.getloadavg(),
        "corpora": {},
    }
    print(
        f"{cores} cores; sha256 {sha / 1e9:.2f} GB/s per core (hashlib); {shard_bytes} shards, prefetch {PREFETCH}; "
        f"load average {os.getloadavg()[0]:.1f} (other work on this machine makes single runs noisy: best of all runs counts)"
    )
    for name, samples, sample_bytes in specs:
        path = corpus(args.data, name, samples, sample_bytes, shard_bytes)
        meta = json.loads((path / "corpus.json").read_text())
        warm(path)
        raw: dict[str, dict[str, Any]] = {}
        for p in range(args.passes):
            for r in readers:
                t = time.perf_counter()
                got = measure(r, path, args.repeat, args.budget)
                print(
                    f"  {name} pass {p + 1} {r}: best {min(got['runs']):.3f} s of {len(got['runs'])} ({time.perf_counter() - t:.0f} s)",
                    flush=True,
                )
                if r not in raw:
                    raw[r] = got
                    continue
                for k in ("runs", "first_item_s"):
                    raw[r][k] += got[k]
                for k in ("rss_mb", "children_rss_mb", "loadavg"):
                    raw[r][k] = max(raw[r][k], got[k])
        rows = {r: summarize(r, meta, raw) for r in readers}
        budget_mb = RSS_BASE_MB + PREFETCH * meta["max_shard_bytes"] / 2**20
        report(name, meta, rows, budget_mb)
        # Hashing every shard on min(cores, prefetch) threads, with nothing else: the best the default settings can do.
        ceiling = meta["samples"] / (meta["tar_bytes"] / (sha * min(cores, PREFETCH)))
        print(
            f"{name}: verify=sha256 cannot exceed {ceiling:,.0f} samples/s here (sha256 of every shard on {min(cores, PREFETCH)} threads)"
        )
        load = max(r["loadavg"] for r in rows.values())
        print(f"{name}: the 1-minute load average reached {load:.1f} during these runs")
        results["corpora"][name] = {
            **meta,
            "sha256_ceiling_samples_per_s": ceiling,
            "rss_budget_mb": budget_mb,
            "max_loadavg": load,
            "readers": rows,
        }
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(results, indent=1))
    print(f"\nraw runs: {json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
