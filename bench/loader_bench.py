"""Benchmark of local-replica read throughput: ``geoshard.loaders`` next to its peers on the same
samples, in the same run.

Two corpora of synthetic WebDataset samples (three fields: ``img``, ``cls``, ``json``): 2,000
samples of 100 KB and 40,000 of 1 KB. Each is made with ``geoshard synth``, split with ``geoshard
split`` for one region (``eu-west-1``, 64 MB compact ustar shards) whose ``local`` is the split
folder, and written again with ``litdata.optimize`` (64 MB chunks) from the split's own shards, so
every reader serves the same samples. Page cache warm.

**One process** (no decoding; the consumer counts samples and the bytes of ``img``), each reader in
its own process (so its peak RSS is its own):

- ``cat`` of the split's shards to /dev/null (the I/O baseline; MB/s of tar bytes);
- LitData 0.2.76 ``StreamingDataset`` (fields come out as memoryviews of its mmapped chunks), and
  the same with each field turned into ``bytes`` by the consumer (what a consumer copying each
  payload pays);
- webdataset 1.0.2 ``WebDataset`` over the split's shards (``shardshuffle=False``, no decoding);
- ``RegionalDataset(plan, "eu-west-1", shuffle=False)`` with fields as ``bytes`` and every shard
  verified by its xxh3-128 (the default), by sha256, or by size only; and with ``copy=False``
  (fields as memoryviews of the mapped shard) with the default check and with size only.

Each reads its corpus once to warm up, times one more pass, then lists the corpus k times so
that an epoch lasts at least ``--single-seconds`` (epochs of a few tens of ms measure the other
work on the machine more than the reader), and runs up to ``--repeat`` timed epochs (fewer past
``--budget`` seconds), in ``--passes`` passes over all readers; the median epoch counts.

**DataLoader, tensor batches, steady state** (2 workers, batches of 64 samples as two tensors:
``img`` uint8 (64, sample bytes) and ``cls`` int64 (64,)): every reader runs ``--epochs`` epochs
of at least ``--epoch-seconds`` each (the corpus is listed K times per epoch, K from a one-epoch
calibration of that reader), and its median epoch counts:

- the ceiling: a ``DataLoader`` whose workers hand out ready-made batches of the same tensors
  (each batch a fresh ``clone()`` of one decoded batch, as any producer makes a new batch; torch
  moves it to shared memory to cross the process boundary);
- ``make_loader(..., decode=TensorSpec({"img": Raw((size,)), "cls": Label()}, keys=False))``
  through ``stream()``: decoded in the workers into reused shared-memory slots;
- webdataset: ``WebDataset(...).map(to numpy)`` in a ``DataLoader(batch_size=64)`` (default collate);
- LitData: ``StreamingDataLoader`` with a collate that stacks its memoryviews into tensors.

The plain DataLoaders keep their workers across epochs (``persistent_workers=True``). Results
print as tables and go to ``--json-out``.

    .venv/bin/python bench/loader_bench.py            # ~20 minutes once the corpora exist (~0.8 GB in bench/_data)
    .venv/bin/python bench/loader_bench.py --quick --passes 1 --epoch-seconds 2 --single-seconds 0.5   # a smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

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
    "geoshard-xxh3",
    "geoshard-sha256",
    "geoshard-size",
    "geoshard-views-xxh3",
    "geoshard-views-size",
)
LABELS = {
    "cat": "cat (tar bytes)",
    "litdata": "LitData StreamingDataset (memoryviews)",
    "litdata-bytes": "LitData, fields as bytes",
    "webdataset": "webdataset WebDataset",
    "geoshard-xxh3": "RegionalDataset, bytes, verify=xxh3 (default)",
    "geoshard-sha256": "RegionalDataset, bytes, verify=sha256",
    "geoshard-size": "RegionalDataset, bytes, verify=size",
    "geoshard-views-xxh3": "RegionalDataset copy=False, verify=xxh3",
    "geoshard-views-size": "RegionalDataset copy=False, verify=size",
}
PEER = {  # each reader's LitData counterpart: views against views, bytes against bytes
    "geoshard-views-xxh3": "litdata",
    "geoshard-views-size": "litdata",
}
DL_READERS = ("ceiling-dl", "same-tensor-dl", "geoshard-dl", "webdataset-dl", "litdata-dl")
DL_LABELS = {
    "ceiling-dl": "ceiling: DataLoader handing out ready batches",
    "same-tensor-dl": "(one tensor object handed out again and again)",
    "geoshard-dl": "make_loader, TensorSpec, stream()",
    "webdataset-dl": "WebDataset + DataLoader",
    "litdata-dl": "LitData StreamingDataLoader",
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


def make_reader(name: str, corpus: Path, k: int = 1) -> Callable[[], Count]:
    """One epoch of reader ``name`` over the corpus listed ``k`` times."""
    plan, shards, lit = (
        repeated(corpus, k) if k > 1 else (corpus / "plan.toml", [str(p) for p in region_shards(corpus)], corpus / "litdata")
    )
    if name == "cat":
        cat = shutil.which("cat") or "cat"

        def read_cat() -> Count:
            subprocess.run([cat, *shards], stdout=subprocess.DEVNULL, check=True, timeout=600)
            return -1, -1, 0.0, 0

        return read_cat
    if name.startswith("litdata"):
        from litdata import StreamingDataset

        lds = StreamingDataset(str(lit))
        return (lambda: count_samples(lds)) if name == "litdata" else (lambda: count_as_bytes(lds))
    if name.startswith("webdataset"):
        import webdataset as wds

        warnings.simplefilter("ignore")
        wdset = wds.WebDataset(shards, shardshuffle=False, empty_check=False)
        return lambda: count_samples(wdset)
    from geoshard.loaders import ChainSettings, RegionalDataset

    settings = ChainSettings(verify=name.rsplit("-", 1)[1])
    ds = RegionalDataset(plan, REGION, shuffle=False, prefetch=PREFETCH, settings=settings, copy="-views" not in name)
    return lambda: count_samples(ds)


def reader_main(name: str, corpus: Path, repeat: int, budget: float, epoch_seconds: float) -> None:
    read = make_reader(name, corpus)
    t0 = time.perf_counter()
    n, b, _, _ = read()  # warm-up: imports inside the readers, page cache
    warm_s = time.perf_counter() - t0
    t = time.perf_counter()
    read()
    # Epochs of a fraction of a second measure the machine's other work more than the reader:
    # the corpus is listed k times, so that an epoch lasts about ``epoch_seconds``.
    k = max(1, math.ceil(epoch_seconds / (time.perf_counter() - t)))
    if k > 1 and name != "cat":
        read = make_reader(name, corpus, k)
        n, b = n * k, b * k
    elif k > 1:
        read, n, b = make_reader(name, corpus, k), -1, -1
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
        "k": k,
        "runs": runs,
        "corpus_per_s": [k / r for r in runs],  # epochs of the corpus listed once, per second
        "first_item_s": firsts,
        "warmup_s": warm_s,
        "rss_mb": hwm_mb(),
        "children_rss_mb": children_maxrss_mb(),
        "loadavg": os.getloadavg()[0],
    }
    print(json.dumps(out))


def measure(name: str, corpus: Path, repeat: int, budget: float, epoch_seconds: float) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--reader", name, "--corpus", str(corpus), "--repeat", str(repeat)]
    out = run([*argv, "--budget", str(budget), "--single-seconds", str(epoch_seconds)], timeout=1800)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


# -- DataLoaders with tensor batches, steady state -------------------------------------------------
def repeated(corpus: Path, k: int) -> tuple[Path, list[str], Path]:
    """The corpus listed ``k`` times: a geoshard plan whose replica manifest names every shard k
    times, the webdataset shard list, and a LitData folder whose index names every chunk k times
    (links to the same files: the same bytes are read k times, nothing is copied)."""
    from geoshard.manifest import RegionManifest, read_region_manifest

    base = corpus / f"repeat-{k}"
    folder = base / REGION
    rm = read_region_manifest(corpus / "split" / REGION)
    if not (base / ".complete").exists():
        shutil.rmtree(base, ignore_errors=True)
        folder.mkdir(parents=True)
        for s in rm.shards:
            (folder / s.path).symlink_to(corpus / "split" / REGION / s.path)
        many = RegionManifest(rm.region, rm.format, rm.generation, rm.plan_sha256, rm.shards * k)
        (folder / "manifest.json").write_bytes(many.to_json())
        (base / "plan.toml").write_text(f'[shards]\nbytes = "64MB"\n\n[regions.{REGION}]\nweight = 1\nlocal = "{folder}"\n')
        lit = base / "litdata"
        lit.mkdir()
        index = json.loads((corpus / "litdata" / "index.json").read_text())
        for p in (corpus / "litdata").iterdir():
            if p.name != "index.json":
                (lit / p.name).symlink_to(p)
        index["chunks"] = index["chunks"] * k
        (lit / "index.json").write_text(json.dumps(index))
        (base / ".complete").touch()
    return base / "plan.toml", [str(folder / s.path) for s in rm.shards] * k, base / "litdata"


def wds_tensors(sample: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    return {"img": np.frombuffer(sample["img"], dtype=np.uint8), "cls": int(sample["cls"])}


def litdata_tensors(samples: list[dict[str, Any]]) -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "img": torch.from_numpy(np.stack([np.frombuffer(s["img"], dtype=np.uint8) for s in samples])),
        "cls": torch.tensor([int(bytes(s["cls"])) for s in samples]),
    }


class ReadyBatches(IterableDataset):  # type: ignore[type-arg]
    """The ceiling: an iterable dataset whose workers hand out ``batches`` ready-made batches."""

    def __init__(self, template: dict[str, Any], batches: int, fresh: bool = True) -> None:
        self.template, self.batches, self.fresh = template, batches, fresh

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for _ in range(wid * self.batches // nw, (wid + 1) * self.batches // nw):
            yield {k: v.clone() for k, v in self.template.items()} if self.fresh else self.template


def tensor_spec(corpus: Path) -> Any:
    from geoshard.loaders.decode import Label, Raw, TensorSpec

    meta = json.loads((corpus / "corpus.json").read_text())
    return TensorSpec({"img": Raw((meta["img_bytes"] // meta["samples"],)), "cls": Label()}, keys=False)


def make_epochs(name: str, corpus: Path, k: int) -> tuple[Callable[[], Iterable[Any]], int]:
    """A function giving one epoch's batches, and the samples in an epoch."""
    import torch
    from torch.utils.data import DataLoader

    meta = json.loads((corpus / "corpus.json").read_text())
    samples = meta["samples"] * k
    plan, shards, lit = repeated(corpus, k)
    if name in ("ceiling-dl", "same-tensor-dl"):
        from geoshard.loaders.decode import fill_batch, unpack
        from geoshard.loaders.shard import Shard

        spec = tensor_spec(corpus)
        first = Shard("first", Path(shards[0]).read_bytes(), "wds", copy=False)
        raw: list[Any] = [first.sample(i % len(first)) for i in range(BATCH)]
        import numpy as np

        buf = np.empty(spec.batch_bytes(BATCH), dtype=np.uint8)
        template = unpack(fill_batch(spec, raw, ["first"] * BATCH, buf), buf)
        template = {k2: v.clone() for k2, v in template.items()}
        ready = ReadyBatches(template, samples // BATCH, fresh=name == "ceiling-dl")
        dl = DataLoader(ready, batch_size=None, num_workers=WORKERS, persistent_workers=True)
        return (lambda: dl), samples // BATCH * BATCH
    if name == "geoshard-dl":
        from geoshard.loaders import make_loader

        loader = make_loader(plan, REGION, batch_size=BATCH, num_workers=WORKERS, shuffle=False, decode=tensor_spec(corpus))
        stream = loader.stream()
        per_epoch = len(loader)
        return (lambda: (next(stream) for _ in range(per_epoch))), samples
    if name == "webdataset-dl":
        import webdataset as wds

        warnings.simplefilter("ignore")
        wdset = wds.WebDataset(shards, shardshuffle=False, empty_check=False).map(wds_tensors)
        dl = DataLoader(wdset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)
        return (lambda: dl), samples
    from litdata import StreamingDataLoader, StreamingDataset

    ldl = StreamingDataLoader(
        StreamingDataset(str(lit)), batch_size=BATCH, num_workers=WORKERS, collate_fn=litdata_tensors, persistent_workers=True
    )
    del torch
    return (lambda: ldl), samples


def steady_main(name: str, corpus: Path, k: int, epochs: int) -> None:
    epoch, want = make_epochs(name, corpus, k)
    runs: list[float] = []
    for _ in range(epochs):
        t = time.perf_counter()
        n = b = 0
        for batch in epoch():
            img = batch["img"]
            n += img.shape[0]
            b += img.numel()
        runs.append(time.perf_counter() - t)
        if n != want or batch["cls"].shape != (img.shape[0],) or str(img.dtype) != "torch.uint8":
            raise SystemExit(f"{name}: an epoch gave {n} samples of {want}, or batches of the wrong shape")
    print(json.dumps({"runs": runs, "samples": n, "img_bytes": b, "rss_mb": hwm_mb(), "children_rss_mb": children_maxrss_mb()}))


def measure_steady(name: str, corpus: Path, k: int, epochs: int) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--steady", name, "--corpus", str(corpus), "--k", str(k)]
    out = run([*argv, "--epochs", str(epochs)], timeout=3600)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def steady(corpus: Path, epoch_seconds: float, epochs: int) -> dict[str, dict[str, Any]]:
    meta = json.loads((corpus / "corpus.json").read_text())
    rows = {}
    for name in DL_READERS:
        # Calibrate: one epoch over the corpus once (start-up included, so the rate is an underestimate).
        probe = measure_steady(name, corpus, 1, 2)
        rate = meta["samples"] / min(probe["runs"])
        k = max(1, math.ceil(epoch_seconds * 1.5 * rate / meta["samples"]))
        t = time.perf_counter()
        got = measure_steady(name, corpus, k, epochs)
        if min(got["runs"]) < epoch_seconds:  # the calibration underestimated the steady rate: longer epochs
            k = math.ceil(k * epoch_seconds * 1.5 / min(got["runs"]))
            got = measure_steady(name, corpus, k, epochs)
        med = statistics.median(got["runs"])
        got.update(k=k, label=DL_LABELS[name], median_s=med, samples_per_s=got["samples"] / med, mb_per_s=got["img_bytes"] / med / 1e6)
        got["epoch_rates"] = [got["samples"] / r for r in got["runs"]]
        rows[name] = got
        print(
            f"  steady {name}: {got['samples_per_s']:,.0f} samples/s (epochs of {', '.join(f'{r:.1f}' for r in got['runs'])} s, "
            f"corpus x{k}; {time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    return rows


def report_steady(name: str, rows: dict[str, dict[str, Any]]) -> None:
    ceiling = rows["ceiling-dl"]["samples_per_s"]
    peers = max(rows[p]["samples_per_s"] for p in ("webdataset-dl", "litdata-dl") if p in rows)
    print(f"\n{name}, DataLoader (2 workers, batches of {BATCH} as tensors), median of steady epochs:")
    header = f"{'reader':48} {'samples/s':>10} {'MB/s':>7} {'/ceiling':>8} {'/best peer':>10} {'epochs (s)':>18} {'RSS MiB':>7}"
    print(header)
    print("-" * len(header))
    for row in rows.values():
        row["vs_ceiling"] = row["samples_per_s"] / ceiling
        row["vs_best_peer"] = row["samples_per_s"] / peers
        epochs = ", ".join(f"{r:.1f}" for r in row["runs"])
        print(
            f"{row['label']:48} {row['samples_per_s']:>10,.0f} {row['mb_per_s']:>7,.0f} {row['vs_ceiling']:>8.2f} "
            f"{row['vs_best_peer']:>10.2f} {epochs:>18} {row['rss_mb']:>7.0f}"
        )


# -- the report ------------------------------------------------------------------------------------
def hash_rates() -> dict[str, float]:
    from geoshard.util import hashing

    block = os.urandom(1 << 20)
    out = {}
    for algorithm in ("sha256", "xxh3_128"):
        best = 0.0
        for _ in range(3):
            h = hashing.new(algorithm)
            t = time.perf_counter()
            for _ in range(128):
                h.update(block)
            best = max(best, 128 * len(block) / (time.perf_counter() - t))
        out[algorithm] = best
    return out


def summarize(name: str, meta: dict[str, Any], raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    r = raw[name]
    per_s = statistics.median(r["corpus_per_s"])  # the median epoch counts
    if name == "cat":
        sps, mbps = meta["samples"] * per_s, meta["tar_bytes"] * per_s / 1e6
    else:
        for k, n, b in zip(r["ks"], r["samples"], r["img_bytes"], strict=True):
            if (n, b) != (meta["samples"] * k, meta["img_bytes"] * k):
                raise SystemExit(
                    f"{name} read {n} samples / {b} img bytes of the corpus x{k}: {meta['samples']} / {meta['img_bytes']} each"
                )
        sps, mbps = meta["samples"] * per_s, meta["payload_bytes"] * per_s / 1e6
    return {
        "reader": name,
        "label": LABELS[name],
        "epoch_s": r["runs"],
        "samples_per_s": sps,
        "mb_per_s": mbps,
        "first_item_best_s": min(r["first_item_s"]),
        **r,
    }


def report(name: str, meta: dict[str, Any], rows: dict[str, dict[str, Any]], budget_mb: float) -> None:
    cat = rows["cat"]["samples_per_s"]
    print(
        f"\n{name}: {meta['samples']:,} samples, {meta['payload_bytes'] / 1e6:,.0f} MB of fields, {meta['tar_bytes'] / 1e6:,.0f} MB in "
        f"{meta['shards']} shards (largest {meta['max_shard_bytes'] / 1e6:.0f} MB); RSS budget {budget_mb:.0f} MiB per process"
    )
    header = f"{'reader':44} {'samples/s':>10} {'MB/s':>7} {'/LitData':>8} {'/cat':>6} {'1st item':>8} {'RSS MiB':>7}"
    print(header)
    print("-" * len(header))
    for key, row in rows.items():
        peer = PEER.get(key, "litdata-bytes")
        row["vs_litdata"] = row["samples_per_s"] / rows[peer]["samples_per_s"]
        row["litdata_peer"] = peer
        row["vs_cat"] = row["samples_per_s"] / cat
        row["rss_budget_mb"] = budget_mb
        first = f"{row['first_item_best_s'] * 1e3:>6.0f}ms" if key != "cat" else " " * 8
        print(
            f"{row['label']:44} {row['samples_per_s']:>10,.0f} {row['mb_per_s']:>7,.0f} {row['vs_litdata']:>8.2f} "
            f"{row['vs_cat']:>6.2f} {first} {row['rss_mb']:>7.0f}"
        )
    print("(/LitData: against LitData with fields as bytes; rows with copy=False against LitData's memoryviews)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data")
    ap.add_argument("--repeat", type=int, default=3, help="timed epochs per one-process reader and pass, at most")
    ap.add_argument("--budget", type=float, default=10.0, help="seconds of timed epochs per reader and pass before it stops repeating")
    ap.add_argument("--single-seconds", type=float, default=2.0, help="the least length of a one-process epoch")
    ap.add_argument("--passes", type=int, default=2, help="passes over the one-process readers (a burst of load spoils one, not all)")
    ap.add_argument("--epochs", type=int, default=3, help="DataLoader epochs per reader (the median counts)")
    ap.add_argument("--epoch-seconds", type=float, default=10.0, help="the least length of a DataLoader epoch")
    ap.add_argument("--quick", action="store_true", help="small corpora and 4 MB shards, for a smoke run")
    ap.add_argument("--readers", default=",".join(READERS), help="one-process readers (cat, litdata and litdata-bytes always run)")
    ap.add_argument("--no-dataloader", action="store_true", help="skip the DataLoader comparison")
    ap.add_argument("--no-single", action="store_true", help="skip the one-process comparison")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    ap.add_argument("--steady", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        reader_main(args.reader, args.corpus, args.repeat, args.budget, args.single_seconds)
        return 0
    if args.steady:
        steady_main(args.steady, args.corpus, args.k, args.epochs)
        return 0
    if importlib.util.find_spec("litdata") is None:
        print("loader_bench: LitData is the peer to beat: .venv/bin/pip install litdata==0.2.76 torch==2.13.0", file=sys.stderr)
        return 2
    readers = [r for r in READERS if r in {"cat", "litdata", "litdata-bytes", *args.readers.split(",")}]
    shard_bytes = "4MB" if args.quick else "64MB"
    scale = 10 if args.quick else 1
    specs = [("100KB", 2_000 // scale, 100_000), ("1KB", 40_000 // scale, 1_000)]
    json_out = args.json_out or args.data / ("loader_bench_quick.json" if args.quick else "loader_bench.json")
    args.data.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    rates = hash_rates()
    import torch

    results: dict[str, Any] = {
        "cores": cores,
        "hash_bytes_per_s": rates,
        "torch": torch.__version__,
        "shard_bytes": shard_bytes,
        "prefetch": PREFETCH,
        "batch_size": BATCH,
        "num_workers": WORKERS,
        "loadavg_start": os.getloadavg(),
        "corpora": {},
    }
    print(
        f"{cores} cores; per core: sha256 {rates['sha256'] / 1e9:.2f} GB/s, xxh3-128 {rates['xxh3_128'] / 1e9:.2f} GB/s; "
        f"{shard_bytes} shards, prefetch {PREFETCH}; load average {os.getloadavg()[0]:.1f} (other work on this machine makes "
        "single runs noisy)"
    )
    for name, samples, sample_bytes in specs:
        path = corpus(args.data, name, samples, sample_bytes, shard_bytes)
        meta = json.loads((path / "corpus.json").read_text())
        warm(path)
        entry: dict[str, Any] = {**meta}
        if not args.no_single:
            raw: dict[str, dict[str, Any]] = {}
            for p in range(args.passes):
                for r in readers:
                    t = time.perf_counter()
                    got = measure(r, path, args.repeat, args.budget, args.single_seconds)
                    got["ks"], got["samples"], got["img_bytes"] = [got["k"]], [got["samples"]], [got["img_bytes"]]
                    print(
                        f"  {name} pass {p + 1} {r}: best {min(got['runs']):.3f} s of {len(got['runs'])} ({time.perf_counter() - t:.0f} s)",
                        flush=True,
                    )
                    if r not in raw:
                        raw[r] = got
                        continue
                    for k in ("runs", "first_item_s", "corpus_per_s", "ks", "samples", "img_bytes"):
                        raw[r][k] += got[k]
                    for k in ("rss_mb", "children_rss_mb", "loadavg"):
                        raw[r][k] = max(raw[r][k], got[k])
            rows = {r: summarize(r, meta, raw) for r in readers}
            budget_mb = RSS_BASE_MB + PREFETCH * meta["max_shard_bytes"] / 2**20
            report(name, meta, rows, budget_mb)
            for algorithm, rate in rates.items():  # hashing every shard on min(cores, prefetch) threads, nothing else
                ceiling = meta["samples"] / (meta["tar_bytes"] / (rate * min(cores, PREFETCH)))
                entry[f"{algorithm}_ceiling_samples_per_s"] = ceiling
                print(f"{name}: verifying with {algorithm} alone caps a reader at {ceiling:,.0f} samples/s here")
            entry.update(rss_budget_mb=budget_mb, max_loadavg=max(r["loadavg"] for r in rows.values()), readers=rows)
        if not args.no_dataloader:
            warm(path)
            dl = steady(path, args.epoch_seconds, args.epochs)
            report_steady(name, dl)
            entry["dataloader"] = dl
        entry["loadavg_end"] = os.getloadavg()
        print(f"{name}: 1-minute load average now {os.getloadavg()[0]:.1f}")
        results["corpora"][name] = entry
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(results, indent=1))
    print(f"\nraw runs: {json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
