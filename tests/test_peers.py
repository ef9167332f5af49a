"""Interop with the real peer libraries: TensorFlow reads what geoshard splits, webdataset too.

The TFRecord tests run TensorFlow in its own venv (``GEOSHARD_TF_PYTHON``, set by the Makefile)
through ``tests/peers/tf_tfrecord.py``: TensorFlow writes the corpus, ``geoshard split`` re-shards
it, TensorFlow reads every shard back. The WebDataset tests use webdataset from this venv.
Without ``GEOSHARD_TF_PYTHON`` the TF tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import gzip
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import webdataset
from click.testing import CliRunner

from geoshard.cli import main
from geoshard.formats.example import parse_example
from geoshard.plan import parse_plan
from geoshard.plan.routing import RouteSpec, key_hash

PEERS = Path(__file__).parent / "peers"
TF_SCRIPT = PEERS / "tf_tfrecord.py"
TF_TIMEOUT = 180
ORIGINS = ("us-east-1", "eu-west-1", "ap-southeast-1")
REGIONS = ("us-east", "eu-west", "ap-south")
ORIGIN_REGION = dict(zip(ORIGINS, REGIONS, strict=True))


# --- the TF venv gate ------------------------------------------------------------------------


def resolve_tf_python(environ: Mapping[str, str]) -> str:
    """The TF venv's python, or skip (outside CI) / fail (CI set) saying why it is unusable."""
    path = environ.get("GEOSHARD_TF_PYTHON", "")
    if not path:
        why = "GEOSHARD_TF_PYTHON is not set (make pytest sets it to .venv-tf/bin/python)"
    elif not (os.path.isfile(path) and os.access(path, os.X_OK)):
        why = f"GEOSHARD_TF_PYTHON={path!r} is not an executable file"
    else:
        return path
    if environ.get("CI"):
        pytest.fail(f"TensorFlow interop tests cannot run under CI: {why}", pytrace=False)
    pytest.skip(f"TensorFlow interop tests need the TF venv: {why}")


@pytest.fixture(scope="module")
def tf_python() -> str:
    return resolve_tf_python(os.environ)


def test_tf_gate_skips_locally_and_fails_under_ci(tmp_path: Path) -> None:
    not_exec = tmp_path / "python"
    not_exec.write_text("#!/bin/sh\n")
    not_exec.chmod(0o644)
    for env in ({}, {"GEOSHARD_TF_PYTHON": ""}, {"GEOSHARD_TF_PYTHON": str(not_exec)}, {"GEOSHARD_TF_PYTHON": str(tmp_path)}):
        with pytest.raises(pytest.skip.Exception, match="GEOSHARD_TF_PYTHON"):
            resolve_tf_python(env)
        with pytest.raises(pytest.fail.Exception, match=r"under CI.*GEOSHARD_TF_PYTHON"):
            resolve_tf_python({**env, "CI": "true"})
    assert resolve_tf_python({"GEOSHARD_TF_PYTHON": sys.executable, "CI": "1"}) == sys.executable


def run_tf(tf_python: str, command: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    spec_path = workdir / f"tf-{command}-spec.json"
    out_path = workdir / f"tf-{command}-out.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [tf_python, str(TF_SCRIPT), command, str(spec_path), str(out_path)],
        shell=False,
        capture_output=True,
        text=True,
        timeout=TF_TIMEOUT,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"{TF_SCRIPT.name} {command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    out = json.loads(out_path.read_text(encoding="utf-8"))
    assert out["tfio_version"] == "0.37.1"
    assert out["tf_version"] == "2.16.2"
    return out


# --- running the split -------------------------------------------------------------------------


def plan_toml(routing: str, shard_samples: int = 0, shard_bytes: str = "64MB") -> str:
    regions = "\n".join(f'[regions."{name}"]\nweight = {w}\n' for name, w in zip(REGIONS, (1, 2, 3), strict=True))
    return f'{routing}\n[shards]\nbytes = "{shard_bytes}"\nsamples = {shard_samples}\n\n{regions}'


HASH_ROUTING = '[routing]\npolicy = "hash"\nkey = "key"\n'  # TFRecord: the feature that names a record
WDS_HASH_ROUTING = '[routing]\npolicy = "hash"\n'  # WebDataset samples are keyed by __key__ (routing.key is refused)
REPLICATE_ROUTING = '[routing]\npolicy = "replicate"\n'


def field_routing(field: str) -> str:
    entries = "\n".join(f'"{o}" = "{r}"' for o, r in ORIGIN_REGION.items())
    return f'[routing]\npolicy = "field"\nfield = "{field}"\n\n[routing.map]\n{entries}\n'


def split(tmp_path: Path, sources: list[Path], toml: str, workers: int = 1) -> tuple[Path, dict[str, Any]]:
    plan = tmp_path / "plan.toml"
    plan.write_text(toml, encoding="utf-8")
    out = tmp_path / "split"
    args = ["split", *map(str, sources), "--plan", str(plan), "--out", str(out), "--workers", str(workers), "--json"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, f"geoshard {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    summary = json.loads(result.stdout)
    assert summary["samples_in"] > 0
    return out, summary


def region_shards(out: Path) -> list[tuple[str, Path, dict[str, Any]]]:
    """(region, shard path, manifest entry) for every shard of every region manifest."""
    shards = []
    for region in REGIONS:
        manifest = json.loads((out / region / "manifest.json").read_text(encoding="utf-8"))
        assert manifest["region"] == region
        for entry in manifest["shards"]:
            path = out / region / entry["path"]
            assert path.is_file(), f"{region}/manifest.json names {entry['path']}, which is missing"
            assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
            assert path.stat().st_size == entry["bytes"]
            shards.append((region, path, entry))
    return shards


# --- TensorFlow / TFRecord -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tf_corpus(tf_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three TFRecord files written by TensorFlow, one GZIP-compressed: 300 records in all."""
    work = tmp_path_factory.mktemp("tf-corpus")
    src = work / "in"
    src.mkdir()
    files = [
        {"path": str(src / "part-0.tfrecord"), "records": 110, "gzip": False},
        {"path": str(src / "part-1.tfrecord.gz"), "records": 95, "gzip": True},
        {"path": str(src / "part-2.tfrecords"), "records": 95, "gzip": False},
    ]
    out = run_tf(tf_python, "write", {"seed": 7, "prefix": "tfk", "origins": list(ORIGINS), "files": files}, work)
    gz = Path(files[1]["path"]).read_bytes()
    assert gz[:2] == b"\x1f\x8b", "TFRecordOptions(compression_type='GZIP') did not write a gzip stream"
    records = [base64.b64decode(r) for f in out["files"] for r in f["records"]]
    assert len(records) == 300
    assert len(set(records)) == 300
    return {"dir": src, "paths": [Path(f["path"]) for f in files], "records": records}


def tf_read_split(tf_python: str, out: Path, work: Path) -> tuple[list[dict[str, Any]], list[tuple[str, Path, dict[str, Any]]]]:
    shards = region_shards(out)
    assert shards, "the split wrote no shards"
    assert all(p.name.endswith(".tfrecord") for _, p, _ in shards)
    read = run_tf(tf_python, "read", {"shards": [{"region": r, "path": str(p)} for r, p, _ in shards]}, work)
    assert [s["path"] for s in read["shards"]] == [str(p) for _, p, _ in shards]
    for got, (region, path, entry) in zip(read["shards"], shards, strict=True):
        assert len(got["records"]) == entry["samples"], f"{region}/{path.name}: manifest says {entry['samples']} samples"
    return read["shards"], shards


def check_tf_records(shards: list[dict[str, Any]], input_records: list[bytes]) -> dict[bytes, str]:
    """Every input record exactly once across regions, byte-identical; parsers agree. Returns record -> region."""
    out_records = [base64.b64decode(r["data"]) for s in shards for r in s["records"]]
    assert Counter(out_records) == Counter(input_records)
    region_of: dict[bytes, str] = {}
    for shard in shards:
        for rec in shard["records"]:
            data = base64.b64decode(rec["data"])
            tf_features = rec["features"]
            assert {n: f["kind"] for n, f in tf_features.items()} == {
                "key": "bytes_list",
                "image": "bytes_list",
                "label": "int64_list",
                "origin": "bytes_list",
            }
            tf_values = {
                n: [base64.b64decode(v) for v in f["values"]] if f["kind"] == "bytes_list" else f["values"] for n, f in tf_features.items()
            }
            assert parse_example(data) == tf_values
            region_of[data] = shard["region"]
    return region_of


@pytest.mark.tf
@pytest.mark.slow
def test_tfrecord_hash_split_reads_back_in_tensorflow(tf_python: str, tf_corpus: dict[str, Any], tmp_path: Path) -> None:
    toml = plan_toml(HASH_ROUTING, shard_samples=25)
    out, summary = split(tmp_path, [tf_corpus["dir"]], toml, workers=2)
    assert summary["format"] == "tfrecord"
    assert summary["samples_in"] == 300
    assert summary["bytes_in"] == sum(p.stat().st_size for p in tf_corpus["paths"])
    shards, listed = tf_read_split(tf_python, out, tmp_path)
    assert all(entry["samples"] <= 25 for _, _, entry in listed)
    region_of = check_tf_records(shards, tf_corpus["records"])
    assert set(region_of.values()) == set(REGIONS)
    # Routed by the "key" feature (routing.key), not by the record bytes.
    route = RouteSpec(parse_plan(toml), "tfrecord")
    for data, region in region_of.items():
        key = parse_example(data)["key"][0]
        assert isinstance(key, bytes)
        assert REGIONS[route.by_hash(key_hash(key))[0]] == region, f"record {key!r} is in {region}"


@pytest.mark.tf
@pytest.mark.slow
def test_tfrecord_field_split_reads_back_in_tensorflow(tf_python: str, tf_corpus: dict[str, Any], tmp_path: Path) -> None:
    out, summary = split(tmp_path, tf_corpus["paths"], plan_toml(field_routing("origin"), shard_bytes="16KB"), workers=2)
    assert summary["samples_in"] == 300
    shards, listed = tf_read_split(tf_python, out, tmp_path)
    assert len(listed) > len(REGIONS), "16KB shards should roll over within a region"
    region_of = check_tf_records(shards, tf_corpus["records"])
    for data, region in region_of.items():
        origin = parse_example(data)["origin"][0]
        assert isinstance(origin, bytes)
        assert ORIGIN_REGION[origin.decode()] == region
    assert set(region_of.values()) == set(REGIONS)


# --- WebDataset ------------------------------------------------------------------------------

Sample = dict[str, bytes]


# Five tar dialects. webdataset.ShardWriter writes through tarfile in its default PAX format (1.0.2
# computes its own ``format`` argument but never passes it on), so:
#   "pax":   ShardWriter, default mtime (a float): every member gets a PAX header, long keys a PAX path;
#   "ustar": ShardWriter, mtime=0: plain one-block ustar headers (geoshard's fast path);
#   "gz":    ShardWriter to .tar.gz (gzip-compressed PAX tar);
#   "gnu":   stdlib tarfile, GNU_FORMAT (as GNU tar writes): GNU magic, 'L' long-name members;
#   "posix": stdlib tarfile, USTAR_FORMAT: long keys split into the ustar prefix field.
WDS_FLAVORS = ("pax", "ustar", "gz", "gnu", "posix")
BIG = ("pax", "ustar")  # flavors with shards over the tar reader's 4 MiB read window
LONG_DIR = "deep/" * 24  # 120 bytes: keys under it do not fit a 100-byte tar name
VERY_LONG_DIR = ("x" * 40 + "/") * 7  # 287 bytes: over ustar's 155-byte prefix + 100-byte name


def wds_key(i: int, flavor: str) -> str:
    if flavor == "ustar":  # plain short ASCII names only: anything else makes tarfile add PAX headers
        return f"grp{i % 4}/s{i:05d}" if i % 5 == 0 else f"s{i:05d}"
    if i % 12 == 3 and flavor != "posix":  # USTAR_FORMAT cannot store it
        return f"{VERY_LONG_DIR}s{i:05d}"
    if i % 6 == 0:
        return f"{LONG_DIR}s{i:05d}"
    if i % 8 == 1:
        return f"ключ/данные-{i:05d}"  # UTF-8 key
    if i % 13 == 7:
        return f"v1.2/s{i:05d}"  # a dot in a folder name is not the key's end
    return f"grp{i % 4}/s{i:05d}" if i % 5 == 0 else f"s{i:05d}"


class TarfileShardWriter:
    """The part of ShardWriter's interface write_wds uses, writing tars of ``format`` with stdlib tarfile."""

    def __init__(self, pattern: str, maxcount: int, format: int) -> None:
        self.pattern, self.maxcount, self.format = pattern, maxcount, format
        self.shard = self.count = 0
        self.tar: tarfile.TarFile | None = None

    def write(self, sample: dict[str, Any]) -> None:
        if self.tar is None or self.count >= self.maxcount:
            self.close()
            self.tar = tarfile.open(self.pattern % self.shard, "w", format=self.format)  # noqa: SIM115 - closed in close()
            self.shard, self.count = self.shard + 1, 0
        for ext, data in sorted(sample.items()):
            if ext != "__key__":
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(data)
                self.tar.addfile(info, io.BytesIO(data))
        self.count += 1

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.tar = None

    def __enter__(self) -> TarfileShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_wds(src: Path, n: int = 300, per_shard: int = 40, seed: int = 3) -> dict[str, Sample]:
    """Shards of each flavor; returns key -> {field: bytes}."""
    rng = random.Random(seed)
    samples: dict[str, Sample] = {}
    src.mkdir(parents=True)
    for f, flavor in enumerate(WDS_FLAVORS):
        pattern = str(src / (f"{flavor}-%04d.tar.gz" if flavor == "gz" else f"{flavor}-%04d.tar"))
        sink: Any
        if flavor in ("gnu", "posix"):
            sink = TarfileShardWriter(pattern, per_shard, tarfile.GNU_FORMAT if flavor == "gnu" else tarfile.USTAR_FORMAT)
        else:
            sink = webdataset.ShardWriter(pattern, maxcount=per_shard, verbose=0, **({"mtime": 0} if flavor == "ustar" else {}))
        with sink:
            for i in range(f * n // len(WDS_FLAVORS), (f + 1) * n // len(WDS_FLAVORS)):
                if flavor in BIG and i % 5 == 4:
                    size = rng.randrange(400_000, 800_000)
                elif i % 7 == 0:
                    size = rng.choice((0, 1, 511, 512, 513, 10_000))
                else:
                    size = rng.randrange(1, 3000)
                sample = {
                    "jpg": rng.randbytes(size),
                    "cls": rng.randbytes(rng.randrange(1, 8)),
                    "json": json.dumps({"origin": ORIGINS[i % 3], "noise": rng.randbytes(12).hex()}).encode(),
                }
                if i % 9 == 2:
                    sample["seg.png"] = rng.randbytes(rng.randrange(0, 700))  # the field is all after the key's first dot
                key = wds_key(i, flavor)
                sink.write({"__key__": key, **sample})
                samples[key] = sample
    return samples


def tar_headers(path: Path) -> list[tuple[bytes, bytes, bytes]]:
    """(typeflag, magic, prefix field) of every header block of a tar (or .tar.gz) file, extension headers included."""
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        assert data[:2] == b"\x1f\x8b"
        data = gzip.decompress(data)
    out = []
    pos = 0
    while pos + 512 <= len(data) and data[pos : pos + 512] != bytes(512):
        header = data[pos : pos + 512]
        out.append((header[156:157], header[257:265], header[345:500].rstrip(b"\0")))
        pos += 512 + (int(header[124:136].strip(b"\0 ") or b"0", 8) + 511) // 512 * 512
    return out


def open_paths() -> set[str]:
    """Files this process has open (Linux)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def read_wds(urls: list[str]) -> list[tuple[str, str, Sample]]:
    """Samples of ``urls`` as webdataset.WebDataset yields them: (shard url, key, {field: bytes}), in order."""
    # webdataset 1.0.2 opens local shards (cache.StreamingOpen) and never closes them; the files
    # close when collected, with a ResourceWarning (webdataset#311, #383). Collect them here, where
    # that one warning is ignored, so it cannot surface as an error in a later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        # 1.0.2 warns unless shardshuffle is set explicitly; counts are checked by the callers, not by empty_check.
        ds = webdataset.WebDataset(urls, shardshuffle=False, empty_check=False)
        samples = [(s["__url__"], s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in ds]
        del ds
        gc.collect()
    assert not open_paths() & {os.path.realpath(u) for u in urls}, "webdataset left shard files open"
    return samples


def wds_region_samples(out: Path) -> dict[str, list[tuple[str, Sample]]]:
    """Region -> its samples (key, fields) as webdataset reads its shards, in manifest order."""
    shards = region_shards(out)
    assert all(p.name.endswith(".tar") for _, p, _ in shards)
    got = read_wds([str(p) for _, p, _ in shards])
    per_shard = Counter(url for url, _, _ in got)
    by_region: dict[str, list[tuple[str, Sample]]] = {region: [] for region in REGIONS}
    region_of = {str(p): region for region, p, _ in shards}
    for region, path, entry in shards:
        assert per_shard[str(path)] == entry["samples"], f"{region}/{path.name}: manifest says {entry['samples']} samples"
    for url, key, sample in got:
        by_region[region_of[url]].append((key, sample))
    return by_region


@pytest.fixture(scope="module")
def wds_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Sample]]:
    src = tmp_path_factory.mktemp("wds-corpus") / "in"
    samples = write_wds(src)
    # The dialects are what the comments above say, so each path of geoshard's tar reader runs.
    shards = {flavor: sorted(src.glob(f"{flavor}-*")) for flavor in WDS_FLAVORS}
    assert all(len(paths) >= 2 for paths in shards.values())
    headers = {flavor: [h for p in paths for h in tar_headers(p)] for flavor, paths in shards.items()}
    typeflags = {flavor: {t for t, _, _ in hs} for flavor, hs in headers.items()}
    magics = {flavor: {m for _, m, _ in hs} for flavor, hs in headers.items()}
    assert typeflags == {"pax": {b"0", b"x"}, "ustar": {b"0"}, "gz": {b"0", b"x"}, "gnu": {b"0", b"L"}, "posix": {b"0"}}
    assert magics["ustar"] == magics["posix"] == {b"ustar\x0000"}
    assert magics["gnu"] == {b"ustar  \x00"}
    assert any(prefix for _, _, prefix in headers["posix"])
    assert not any(prefix for _, _, prefix in headers["ustar"])
    for flavor in BIG:
        assert max(p.stat().st_size for p in shards[flavor]) > 4 << 20, f"{flavor}: samples must cross read windows"
    # The input reads back through webdataset as written (guards the comparisons below).
    back = [(key, sample) for _, key, sample in read_wds(sorted(str(p) for p in src.iterdir()))]
    assert dict(back) == samples
    assert len(back) == len(samples) == 300
    assert sum(k.startswith(LONG_DIR) for k in samples) >= 20
    assert sum(k.startswith(VERY_LONG_DIR) for k in samples) >= 10
    assert sum(not k.isascii() for k in samples) >= 10
    assert sum("seg.png" in sample for sample in samples.values()) >= 20
    return src, samples


@pytest.mark.slow
@pytest.mark.parametrize("routing", [WDS_HASH_ROUTING, field_routing("json.origin")], ids=["hash", "field-json"])
def test_wds_split_reads_back_in_webdataset(wds_corpus: tuple[Path, dict[str, Sample]], tmp_path: Path, routing: str) -> None:
    src, samples = wds_corpus
    out, summary = split(tmp_path, [src], plan_toml(routing, shard_bytes="64KB"), workers=2)
    assert summary["format"] == "wds"
    assert summary["samples_in"] == len(samples)
    by_region = wds_region_samples(out)
    everything = [s for got in by_region.values() for s in got]
    keys = Counter(k for k, _ in everything)
    assert keys == Counter(samples.keys()), "each input sample must appear exactly once across regions"
    assert dict(everything) == samples
    assert all(by_region[r] for r in REGIONS), "every region should get samples"
    if "json.origin" in routing:
        for region, got in by_region.items():
            for key, sample in got:
                assert ORIGIN_REGION[json.loads(sample["json"])["origin"]] == region, f"{key} is in {region}"


@pytest.mark.slow
def test_wds_replicate_puts_every_sample_in_every_region(wds_corpus: tuple[Path, dict[str, Sample]], tmp_path: Path) -> None:
    src, samples = wds_corpus
    out, summary = split(tmp_path, sorted(src.iterdir()), plan_toml(REPLICATE_ROUTING, shard_bytes="64KB"), workers=1)
    assert summary["samples_in"] == len(samples)
    by_region = wds_region_samples(out)
    for region, got in by_region.items():
        assert len(got) == len(samples), f"{region}: {len(got)} samples, expected all {len(samples)}"
        assert dict(got) == samples, f"{region} differs from the input"
        assert summary["regions"][region]["samples"] == len(samples)
    # Replicas hold the samples in the same order too: each group writes them as it reads them.
    first = by_region[REGIONS[0]]
    assert all(by_region[r] == first for r in REGIONS[1:])
