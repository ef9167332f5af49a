"""Helpers shared by the split tests: plans, corpora, and reading a split back."""

from __future__ import annotations

import hashlib
import io
from collections import Counter
from pathlib import Path

from geoshard.formats import tfrecord, wds
from geoshard.local.synth import SynthSpec, synth
from geoshard.manifest import read_manifest, read_region_manifest

REGIONS = ("us-east-1", "eu-west-1", "ap-southeast-1")


def write_plan(
    path: Path, policy: str = "hash", weights: tuple[float, ...] = (2, 1, 1), shard_bytes: str = "256KB", extra: str = ""
) -> Path:
    lines = [f'[routing]\npolicy = "{policy}"']
    if policy == "field":
        lines.append('field = "json.origin"' if "field =" not in extra else "")
    lines.append(extra)
    if policy == "field" and "[routing.map]" not in extra:
        lines.append("[routing.map]\n" + "\n".join(f'"{r}" = "{r}"' for r in REGIONS))
    lines.append(f'[shards]\nbytes = "{shard_bytes}"')
    for r, w in zip(REGIONS, weights, strict=True):
        lines.append(f"[regions.{r}]\nweight = {w}")
    path.write_text("\n".join(lines) + "\n")
    return path


def make_corpus(
    path: Path, fmt: str = "wds", samples: int = 2000, sample_bytes: int = 200, shard_samples: int = 250, seed: int = 0
) -> list[Path]:
    return synth(SynthSpec(out=path, fmt=fmt, samples=samples, sample_bytes=sample_bytes, shard_samples=shard_samples, seed=seed))  # type: ignore[arg-type]


def read_corpus(paths: list[Path], fmt: str) -> Counter[bytes]:
    """Every sample as one canonical bytes value (key + fields, or the record), counted."""
    out: Counter[bytes] = Counter()
    for p in paths:
        with open(p, "rb") as f:
            if fmt == "wds":
                for key, members in wds.iter_samples(f, str(p)):
                    out[key + b"\0" + b"\0".join(n + b"=" + hashlib.sha256(d).digest() for n, d in members)] += 1
            else:
                for rec in tfrecord.iter_records(f, str(p)):
                    out[rec] += 1
    return out


def region_shards(out: Path) -> dict[str, list[Path]]:
    m = read_manifest(out)
    result = {}
    for name, summary in m.regions.items():
        rm = read_region_manifest(out / summary.manifest)
        result[name] = [(out / summary.manifest).parent / s.path for s in rm.shards]
    return result


def region_keys(out: Path) -> dict[bytes, str]:
    """key -> region for a WebDataset split."""
    where = {}
    for region, paths in region_shards(out).items():
        for p in paths:
            with open(p, "rb") as f:
                for key, _ in wds.iter_raw_samples(f, str(p)):
                    where[key] = region
    return where


def tree_digest(out: Path) -> dict[str, str]:
    """sha256 of every file under ``out`` by relative path (the top manifest excluded)."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and p != out / "manifest.json"
    }


def tar_bytes(members: list[tuple[bytes, bytes]]) -> bytes:
    buf = io.BytesIO()
    w = wds.TarWriter(buf)
    for n, d in members:
        w.write_member(n, d)
    w.close()
    return buf.getvalue()
