"""The manifests: the contract between split, sync, the loaders and users.

``DIR/manifest.json`` describes a split (plan, sources, generation, regions) and
``DIR/<region>/manifest.json`` lists that region's shards with their sha256, xxh3-128 and (since
issue 12) per-chunk xxh3-128. Shard paths are
relative to the region manifest's folder, never absolute, never containing ``..``.
Region manifests are deterministic (no timestamps) so equal splits give equal bytes.
"""

from __future__ import annotations

import builtins
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoshard.errors import DataError
from geoshard.formats import FORMATS
from geoshard.manifest import checks
from geoshard.util.paths import plain_relative

MANIFEST = "manifest.json"
VERSION = 1


@dataclass(frozen=True)
class ShardChunks:
    """A shard cut into chunks of whole samples, each with its own fast hash (docs/manifest.md).

    A chunk ends at the first sample boundary at or past ``size`` bytes (the last one also holds
    the tar's end blocks), so any chunk can be read, checked and parsed alone."""

    size: int
    bytes: tuple[int, ...]  # per chunk
    samples: tuple[int, ...]  # per chunk
    xxh3_128: tuple[str, ...]  # per chunk, 32 hex digits

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "bytes": list(self.bytes), "samples": list(self.samples), "xxh3_128": list(self.xxh3_128)}

    @classmethod
    def from_dict(cls, d: Any, where: str, shard_bytes: int, shard_samples: int) -> ShardChunks:
        try:
            c = cls(
                size=checks.count(d["size"], "chunks.size", where),
                bytes=tuple(checks.count(b, "chunks.bytes", where) for b in checks.listing(d["bytes"], "chunks.bytes", where)),
                samples=tuple(checks.count(n, "chunks.samples", where) for n in checks.listing(d["samples"], "chunks.samples", where)),
                xxh3_128=tuple(str(h) for h in checks.listing(d["xxh3_128"], "chunks.xxh3_128", where)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: chunks: missing or invalid {e}") from e
        n = len(c.bytes)
        if not n or len(c.samples) != n or len(c.xxh3_128) != n:
            raise DataError(f"{where}: chunks: bytes, samples and xxh3_128 must list the same number of chunks (at least one)")
        if sum(c.bytes) != shard_bytes or sum(c.samples) != shard_samples or min(c.bytes) <= 0 or min(c.samples) < 0:
            raise DataError(f"{where}: chunks: their bytes and samples must add up to the shard's ({shard_bytes}, {shard_samples})")
        if not all(len(h) == 32 and all(ch in _HEX for ch in h) for h in c.xxh3_128):
            raise DataError(f"{where}: chunks: every xxh3_128 must be 32 lowercase hex digits")
        return c


_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ShardEntry:
    path: str
    samples: int
    bytes: int
    sha256: str
    group: int = 0
    xxh3_128: str = ""  # the fast hash of record (geoshard/util/hashing.py); "" in manifests written before it
    chunks: ShardChunks | None = None  # per-chunk hashes; None in manifests written before them

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256, "group": self.group}
        if self.xxh3_128:
            d["xxh3_128"] = self.xxh3_128
        if self.chunks is not None:
            d["chunks"] = self.chunks.to_dict()
        return d

    @classmethod
    def from_dict(cls, s: Any, name: str, index: int = 0, fmt: str = "wds") -> ShardEntry:
        field = f"shards[{index}]"
        s = checks.mapping(s, field, name)
        path = check_relpath(str(s["path"]), name)
        samples, size = checks.count(s["samples"], f"{field}.samples", name), checks.count(s["bytes"], f"{field}.bytes", name)
        checks.samples_fit(samples, size, fmt, f"{field} ({path})", name)
        chunks = s.get("chunks")
        return cls(
            path=path,
            samples=samples,
            bytes=size,
            sha256=str(s["sha256"]),
            group=checks.count(s.get("group", 0), f"{field}.group", name),
            xxh3_128=str(s.get("xxh3_128", "")),
            chunks=None if chunks is None else ShardChunks.from_dict(chunks, f"{name}: shard {path}", size, samples),
        )


@dataclass(frozen=True)
class RegionManifest:
    region: str
    format: str
    generation: int
    plan_sha256: str
    shards: tuple[ShardEntry, ...]

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "region": self.region,
            "format": self.format,
            "generation": self.generation,
            "plan_sha256": self.plan_sha256,
            "samples": self.samples,
            "bytes": self.bytes,
            "shards": [s.to_dict() for s in self.shards],
        }

    def to_json(self) -> builtins.bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any, name: str) -> RegionManifest:
        try:
            d = checks.mapping(d, "the manifest", name)
            if d["format"] not in FORMATS:
                raise DataError(f"{name}: format must be 'wds' or 'tfrecord', got {d['format']!r}")
            entries = checks.listing(d["shards"], "shards", name)
            shards = tuple(ShardEntry.from_dict(s, name, i, d["format"]) for i, s in enumerate(entries))
            _no_repeats(shards, name)
            return cls(
                region=str(d["region"]),
                format=str(d["format"]),
                generation=checks.count(d.get("generation", 0), "generation", name),
                plan_sha256=str(d.get("plan_sha256", "")),
                shards=shards,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DataError(f"{name}: not a geoshard region manifest (missing or invalid {e})") from e


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


def _no_repeats(shards: tuple[ShardEntry, ...], name: str) -> None:
    seen: set[str] = set()
    for i, s in enumerate(shards):
        if s.path in seen:
            raise DataError(f"{name}: shards[{i}].path: shard {s.path} is listed twice")
        seen.add(s.path)


def _load_json(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > checks.MAX_MANIFEST_BYTES:  # refused before a byte of it is read
                raise DataError(f"{path}: {size:,} bytes, more than a manifest may hold ({checks.MAX_MANIFEST_BYTES:,})")
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: manifest not found") from None
    except OSError as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from e
    return checks.parse(data, str(path))


def read_manifest(directory: str | Path) -> Manifest:
    path = Path(directory) / MANIFEST
    return Manifest.from_dict(_load_json(path), str(path))


def read_split_or_region(directory: str | Path) -> Manifest | RegionManifest:
    """The manifest in ``directory``: a split's top manifest, or a region manifest (one region of
    a split, a pulled replica, a copy of a bucket), told apart by their keys."""
    path = Path(directory) / MANIFEST
    d = _load_json(path)
    if isinstance(d, dict) and "regions" not in d and "shards" in d:
        return RegionManifest.from_dict(d, str(path))
    return Manifest.from_dict(d, str(path))


def read_region_manifest(path: str | Path) -> RegionManifest:
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST
    return RegionManifest.from_dict(_load_json(p), str(p))


def parse_region_manifest(data: bytes, name: str) -> RegionManifest:
    return RegionManifest.from_dict(checks.parse(data, name), name)
