"""Synthetic corpora for the demo, tests and benchmarks.

Each sample has image-like bytes (a smooth gradient with noise, so it is neither constant nor
random), an integer label and an ``origin`` region. WebDataset samples are ``<key>.img``,
``<key>.cls`` and ``<key>.json`` (``{"label", "origin"}``); TFRecord records are
``tf.train.Example`` with features ``key``, ``image``, ``label`` and ``origin``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from geoshard.errors import ConfigError
from geoshard.formats import SHARD_SUFFIX, Format, SynthSample, format_spec

NUM_CLASSES = 10
_NAME = re.compile(r"^train-\d{5}(" + "|".join(re.escape(s) for s in SHARD_SUFFIX.values()) + ")$")


@dataclass(frozen=True)
class SynthSpec:
    out: Path
    fmt: Format
    samples: int
    sample_bytes: int
    shard_samples: int
    origins: tuple[str, ...] = ("us-east-1", "eu-west-1", "ap-southeast-1")
    seed: int = 0

    def __post_init__(self) -> None:
        for k in ("samples", "sample_bytes", "shard_samples"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"--{k.replace('_', '-')} must be > 0")
        if not self.origins or any(not o for o in self.origins):
            raise ConfigError("--origins must list at least one region name")


def _image(rng: random.Random, label: int, size: int, base: bytes) -> bytes:
    # A class-dependent pattern plus noise: learnable by a small model, cheap to make.
    start = (label * 37 + rng.randrange(16)) % len(base)
    body = (base[start:] + base[:start]) * (size // len(base) + 1)
    return body[:size]


def synth_files(folder: Path) -> list[Path]:
    """The shards a synth run wrote to ``folder`` (its names only: ``train-NNNNN.tar|.tfrecord``)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name) and p.is_file())


def synth(spec: SynthSpec) -> list[Path]:
    """Write the corpus; shards of an earlier run into ``spec.out`` that this one does not
    rewrite (more shards then, or the other format) are removed, so a split of the folder reads
    this corpus only. Other files in the folder are left alone."""
    spec.out.mkdir(parents=True, exist_ok=True)
    earlier = synth_files(spec.out)
    rng = random.Random(spec.seed)  # noqa: S311 - reproducible test data, not secrets
    base = bytes((i * 7 + (i >> 3)) & 0xFF for i in range(1021))
    paths = []
    nshards = (spec.samples + spec.shard_samples - 1) // spec.shard_samples
    fs = format_spec(spec.fmt)
    for s in range(nshards):
        path = spec.out / f"train-{s:05d}{fs.suffix}"
        with open(path, "wb") as f:
            first = s * spec.shard_samples
            fs.write_synthetic(f, _samples(spec, rng, base, range(first, min(first + spec.shard_samples, spec.samples))))
        paths.append(path)
    for old in set(earlier) - set(paths):
        old.unlink(missing_ok=True)
    return paths


def _samples(spec: SynthSpec, rng: random.Random, base: bytes, indices: range) -> Iterator[SynthSample]:
    for i in indices:
        label = rng.randrange(NUM_CLASSES)
        origin = spec.origins[rng.randrange(len(spec.origins))]
        yield SynthSample(f"s{i:08d}", _image(rng, label, spec.sample_bytes, base), label, origin)


def parse_origins(text: str | None) -> Sequence[str] | None:
    return None if text is None else tuple(o.strip() for o in text.split(",") if o.strip())
