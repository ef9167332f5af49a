"""The manifests: the contract between split, sync, the loaders and users.

``DIR/manifest.json`` describes a split (plan, sources, generation, regions) and
``DIR/<region>/manifest.json`` lists that region's shards with their sha256, xxh3-128 and (since
issue 12) per-chunk xxh3-128. Shard paths are
relative to the region manifest's folder, never absolute, never containing ``..``.
Region manifests are deterministic (no timestamps) so equal splits give equal bytes.
"""

from __future__ import annotations

import builtins
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from geoshard.errors import DataError
from geoshard.formats import FORMATS, format_spec
from geoshard.manifest import checks, stream
from geoshard.manifest.entry import ShardEntry, v1_row
from geoshard.manifest.table import Rows, ShardTable
from geoshard.util.paths import plain_relative

MANIFEST = "manifest.json"
VERSION = 1  # what a small split writes unless asked for 2 (one entry per shard, chunk indexes beside the shards)
# From this many shards in a region a split writes version 2 unless asked for 1: version 1 then
# takes ~1 s of CPU and ~80 MB to open in every process (docs/benchmarks.md), and grows linearly.
# Below it version 1 opens in a fraction of that and a reader needs no GET per shard for its
# chunks (the loader fetches a version 2 shard's index before planning its chunks).
V2_FROM_SHARDS = 10_000


def default_version(most_shards: int, previous: int = VERSION) -> int:
    """The region manifests' version a split writes when not told: 2 once a region holds
    ``V2_FROM_SHARDS`` shards (a version 1 folder that grows that far moves to 2), else the
    version of the split it replaces (``previous``), else 1."""
    return 2 if most_shards >= V2_FROM_SHARDS else previous


VERSIONS = (1, 2)


@dataclass(frozen=True)
class RegionManifest:
    """A region's shards. ``version`` 1 lists each shard with its chunks inline; version 2 keeps
    one entry per shard in columns and each shard's chunks in ``<shard>.chunks`` beside it."""

    region: str
    format: str
    generation: int
    plan_sha256: str
    shards: Sequence[ShardEntry]  # a ShardTable once built (any sequence of entries is converted)
    version: int = VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.from_entries(self.shards))
        if self.version not in VERSIONS:
            raise ValueError(f"region manifest version must be one of {VERSIONS}, got {self.version}")

    @property
    def table(self) -> ShardTable:
        assert isinstance(self.shards, ShardTable)
        return self.shards

    @property
    def samples(self) -> int:
        return int(self.table.column("samples").sum())

    @property
    def bytes(self) -> int:
        return int(self.table.column("bytes").sum())

    def to_dict(self) -> dict[str, Any]:
        shards: Any = self.table.to_columns() if self.version == 2 else [s.to_dict() for s in self.shards]
        head = {"version": self.version, "region": self.region, "format": self.format, "generation": self.generation}
        return head | {"plan_sha256": self.plan_sha256, "samples": self.samples, "bytes": self.bytes, "shards": shards}

    def to_json(self) -> builtins.bytes:
        return dumps(self.to_dict())


def _region_from(f: IO[builtins.bytes], name: str) -> RegionManifest | dict[str, Any]:
    """The region manifest in ``f``, or the top-level object when it has no ``shards`` (a split's)."""
    rows = Rows()
    try:
        d = stream.load(f, name, lambda s, i, before: rows.add(*v1_row(s, name, i, before.get("format"))))
        if "shards" not in d:
            return d
        version = checks.count(d.get("version", 1), "version", name)
        if version not in VERSIONS:
            raise DataError(f"{name}: region manifest version {version} is newer than this geoshard reads ({VERSIONS}); upgrade geoshard")
        fmt = d["format"]
        if fmt not in FORMATS:
            raise DataError(f"{name}: format must be 'wds' or 'tfrecord', got {fmt!r}")
        if version == 1 and d["shards"] is not None:
            checks.listing(d["shards"], "shards", name)
        table = rows.table() if version == 1 else ShardTable.from_columns(d["shards"], name)
        _check_table(table, fmt, name)
        return RegionManifest(
            region=str(d["region"]),
            format=str(fmt),
            generation=checks.count(d.get("generation", 0), "generation", name),
            plan_sha256=str(d.get("plan_sha256", "")),
            shards=table,
            version=version,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{name}: not a geoshard region manifest (missing or invalid {e})") from e


def _check_table(table: ShardTable, fmt: str, name: str) -> None:
    """Samples that fit their shard (per format), and no shard listed twice."""
    most = table.column("bytes") // format_spec(fmt, name).min_sample_bytes
    over = np.flatnonzero(table.column("samples") > most)
    if len(over):
        i = int(over[0])
        checks.samples_fit(int(table.column("samples")[i]), int(table.column("bytes")[i]), fmt, f"shards[{i}] ({table.path(i)})", name)
    paths = table.paths()
    if len(set(paths)) != len(paths):
        seen: set[str] = set()
        for i, p in enumerate(paths):
            if p in seen:
                raise DataError(f"{name}: shards[{i}].path: shard {p} is listed twice")
            seen.add(p)


@dataclass(frozen=True)
class SourceEntry:
    """An input as the split read it. Splits record its xxh3_128 (the change check of an
    incremental split needs no cryptographic hash; the shards keep their sha256); manifests
    written before that record its sha256, and still read and compare."""

    url: str
    size: int
    sha256: str
    group: int
    xxh3_128: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.url, "size": self.size}
        d |= {"sha256": self.sha256} if self.sha256 else {}
        d |= {"xxh3_128": self.xxh3_128} if self.xxh3_128 else {}
        return d | {"group": self.group}


@dataclass(frozen=True)
class RegionSummary:
    manifest: str
    shards: int
    samples: int
    bytes: int
    sha256: str  # of the region manifest's bytes

    def to_dict(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "shards": self.shards, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    generation: int
    created: str
    format: str
    plan: dict[str, Any]
    plan_sha256: str
    layout_sha256: str
    regions: dict[str, RegionSummary]
    sources: tuple[SourceEntry, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "generation": self.generation,
            "created": self.created,
            "format": self.format,
            "plan": self.plan,
            "plan_sha256": self.plan_sha256,
            "layout_sha256": self.layout_sha256,
            "regions": {n: r.to_dict() for n, r in sorted(self.regions.items())},
            "sources": [s.to_dict() for s in self.sources],
        }

    def to_json(self) -> bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any, name: str) -> Manifest:
        try:
            d = checks.mapping(d, "the manifest", name)
            regions = {}
            for rname, r in checks.mapping(d["regions"], "regions", name).items():
                r = checks.mapping(r, f"regions.{rname}", name)
                regions[rname] = RegionSummary(
                    manifest=check_relpath(str(r["manifest"]), name),
                    shards=checks.count(r.get("shards", 0), f"regions.{rname}.shards", name),
                    samples=checks.count(r.get("samples", 0), f"regions.{rname}.samples", name),
                    bytes=checks.count(r.get("bytes", 0), f"regions.{rname}.bytes", name),
                    sha256=str(r.get("sha256", "")),
                )
            return cls(
                generation=checks.count(d["generation"], "generation", name),
                created=str(d.get("created", "")),
                format=str(d["format"]),
                plan=dict(d["plan"]),
                plan_sha256=str(d["plan_sha256"]),
                layout_sha256=str(d.get("layout_sha256", "")),
                regions=regions,
                sources=tuple(
                    SourceEntry(
                        url=str(s["url"]),
                        size=checks.count(s["size"], f"sources[{i}].size", name),
                        sha256=str(s.get("sha256", "")),
                        group=checks.count(s.get("group", 0), f"sources[{i}].group", name),
                        xxh3_128=str(s.get("xxh3_128", "")),
                    )
                    for i, s in enumerate(checks.listing(d.get("sources", []), "sources", name))
                ),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DataError(f"{name}: not a geoshard manifest (missing or invalid {e})") from e


def dumps(d: dict[str, Any]) -> bytes:
    return (json.dumps(d, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def check_relpath(path: str, name: str) -> str:
    """The one path check (geoshard/util/paths.py): plain, relative, inside the manifest's folder."""
    return plain_relative(path, name)


def _opened(path: Path) -> IO[builtins.bytes]:
    try:
        f = path.open("rb")
        size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise DataError(f"{path}: manifest not found") from None
    except OSError as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from e
    if size > checks.MAX_MANIFEST_BYTES:  # refused before a byte of it is read
        f.close()
        raise DataError(f"{path}: {size:,} bytes, more than a manifest may hold ({checks.MAX_MANIFEST_BYTES:,})")
    return f


def _read(path: Path) -> RegionManifest | dict[str, Any]:
    with _opened(path) as f:
        try:
            return _region_from(f, str(path))
        except OSError as e:
            raise DataError(f"{path}: unreadable manifest: {e}") from e


def read_manifest(directory: str | Path) -> Manifest:
    path = Path(directory) / MANIFEST
    d = _read(path)
    if isinstance(d, RegionManifest):
        raise DataError(f"{path}: not a geoshard manifest (missing or invalid 'regions')")
    return Manifest.from_dict(d, str(path))


def read_split_or_region(directory: str | Path) -> Manifest | RegionManifest:
    """The manifest in ``directory``: a split's top manifest, or a region manifest (one region of
    a split, a pulled replica, a copy of a bucket), told apart by their keys."""
    path = Path(directory) / MANIFEST
    d = _read(path)
    return d if isinstance(d, RegionManifest) else Manifest.from_dict(d, str(path))


def read_region_manifest(path: str | Path) -> RegionManifest:
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST
    d = _read(p)
    if not isinstance(d, RegionManifest):
        raise DataError(f"{p}: not a geoshard region manifest (missing or invalid 'shards')")
    return d


def parse_region_manifest(data: builtins.bytes, name: str) -> RegionManifest:
    if len(data) > checks.MAX_MANIFEST_BYTES:
        raise DataError(f"{name}: {len(data):,} bytes, more than a manifest may hold ({checks.MAX_MANIFEST_BYTES:,})")
    d = _region_from(io.BytesIO(data), name)
    if not isinstance(d, RegionManifest):
        raise DataError(f"{name}: not a geoshard region manifest (missing or invalid 'shards')")
    return d
