"""Re-hash every shard of a split against its manifest."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from geoshard.manifest import MANIFEST, RegionManifest, read_region_manifest, read_split_or_region
from geoshard.paths import check_shard_path, plain_relative


@dataclass
class VerifyReport:
    checked: int = 0
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched


def file_digests(path: Path, *algorithms: str) -> tuple[dict[str, str], int]:
    """Hex digests of a file in one pass, and its size."""
    hashes = {a: hashlib.new(a, usedforsecurity=False) if a == "md5" else hashlib.new(a) for a in algorithms}
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            for h in hashes.values():
                h.update(chunk)
            n += len(chunk)
    return {a: h.hexdigest() for a, h in hashes.items()}, n


def sha256_file(path: Path) -> tuple[str, int]:
    digests, n = file_digests(path, "sha256")
    return digests["sha256"], n


def verify_region(rdir: Path, rm: RegionManifest, report: VerifyReport) -> None:
    for s in rm.shards:
        p = rdir / check_shard_path(s.path, str(rdir / MANIFEST))
        report.checked += 1
        if not p.is_file():
            report.missing.append(str(p))
            continue
        sha, n = sha256_file(p)
        if sha != s.sha256 or n != s.bytes:
            report.mismatched.append(str(p))


def verify_split(directory: Path) -> tuple[dict[str, RegionManifest], VerifyReport]:
    """Every shard of the split in ``directory``, or of the one region whose manifest it holds."""
    m = read_split_or_region(directory)
    report = VerifyReport()
    if isinstance(m, RegionManifest):
        verify_region(directory, m, report)
        return {m.region: m}, report
    regions = {}
    for name, summary in m.regions.items():
        rpath = directory / plain_relative(summary.manifest, str(directory / MANIFEST))
        rm = read_region_manifest(rpath)
        regions[name] = rm
        verify_region(rpath.parent, rm, report)
    return regions, report


__all__ = ["MANIFEST", "VerifyReport", "file_digests", "sha256_file", "verify_region", "verify_split"]
