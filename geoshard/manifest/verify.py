"""Re-hash every shard of a split (or a replica) against its manifest.

``xxh3`` (the default) checks each shard's ``xxh3_128`` at memory speed, or its sha256 where the
manifest predates the fast hash; ``sha256`` always checks the cryptographic digest (a check
against tampering, not only against damage). The size is checked first in both. A shard whose
bytes match is then counted: a manifest whose sample count differs from what the shard holds
would make the loader serve fewer samples than it claims, or index past the end. A version 2
shard's chunk index is checked against the digest its entry records.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from geoshard.errors import DataError
from geoshard.formats import format_spec
from geoshard.manifest import MANIFEST, RegionManifest, ShardChunks, ShardEntry, chunkindex, read_region_manifest, read_split_or_region
from geoshard.util.hashing import FAST, file_digests
from geoshard.util.paths import check_shard_path, plain_relative

MODES = ("xxh3", "sha256")
log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    checked: int = 0
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    hashes: set[str] = field(default_factory=set)  # the digests checked (sha256 where a manifest has no xxh3_128)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched


def algorithm_for(shard: ShardEntry, mode: str) -> str:
    """The digest ``mode`` checks ``shard`` by: its xxh3_128 if it has one and the mode allows."""
    if mode not in MODES:
        raise ValueError(f"unknown verify mode {mode!r}; one of {', '.join(MODES)}")
    return FAST if mode == "xxh3" and shard.xxh3_128 else "sha256"


def shard_matches(path: Path, shard: ShardEntry, mode: str = "xxh3") -> bool:
    """Whether the file holds the shard's bytes: its size, then its digest under ``mode``."""
    algorithm = algorithm_for(shard, mode)
    if not path.is_file() or path.stat().st_size != shard.bytes:
        return False
    digests, n = file_digests(path, algorithm)
    return n == shard.bytes and digests[algorithm] == (shard.xxh3_128 if algorithm == FAST else shard.sha256)


def sha256_file(path: Path) -> tuple[str, int]:
    digests, n = file_digests(path, "sha256")
    return digests["sha256"], n


def count_samples(path: Path, fmt: str) -> int:
    """The samples the shard file holds, as the loader groups them."""
    with path.open("rb") as f:
        return sum(1 for _ in format_spec(fmt, str(path)).samples(f, str(path)))


def _counts_match(path: Path, shard: ShardEntry, fmt: str) -> bool:
    try:
        n = count_samples(path, fmt)
    except DataError as e:
        log.warning("%s", e)
        return False
    if n != shard.samples:
        log.warning("%s: holds %d samples, its manifest says %d", path, n, shard.samples)
    return n == shard.samples


def verify_region(rdir: Path, rm: RegionManifest, report: VerifyReport, mode: str = "xxh3") -> None:
    for s in rm.shards:
        p = rdir / check_shard_path(s.path, str(rdir / MANIFEST))
        report.checked += 1
        report.hashes.add(algorithm_for(s, mode))
        if not p.is_file():
            report.missing.append(str(p))
        elif not shard_matches(p, s, mode) or not _counts_match(p, s, rm.format):
            report.mismatched.append(str(p))
        if s.chunk_index:
            _check_index(rdir / chunkindex.index_name(s.path), s, report)


def _check_index(path: Path, shard: ShardEntry, report: VerifyReport) -> None:
    """A version 2 shard's chunk index: present, of the digest its manifest records, and whole."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        report.missing.append(str(path))
        return
    try:
        check_index(data, str(path), shard)
    except DataError as e:
        log.warning("%s", e)
        report.mismatched.append(str(path))


def check_index(data: bytes, where: str, shard: ShardEntry) -> None:
    """Refuse (DataError, one line) an index that is not the one ``shard``'s entry records, or
    that does not describe the shard whole."""
    if chunkindex.digest(data) != shard.chunk_index:
        raise DataError(f"{where}: does not match the chunk_index of its manifest")
    ShardChunks.from_index(data, where, shard.bytes, shard.samples)


def index_matches(path: Path, shard: ShardEntry) -> bool:
    """Whether the file is the chunk index ``shard``'s entry records (``pull``'s check)."""
    try:
        check_index(path.read_bytes(), str(path), shard)
    except (OSError, DataError):
        return False
    return True


def verify_split(directory: Path, mode: str = "xxh3") -> tuple[dict[str, RegionManifest], VerifyReport]:
    """Every shard of the split in ``directory``, or of the one region whose manifest it holds."""
    m = read_split_or_region(directory)
    report = VerifyReport()
    if isinstance(m, RegionManifest):
        verify_region(directory, m, report, mode)
        return {m.region: m}, report
    regions = {}
    for name, summary in m.regions.items():
        rpath = directory / plain_relative(summary.manifest, str(directory / MANIFEST))
        rm = read_region_manifest(rpath)
        regions[name] = rm
        verify_region(rpath.parent, rm, report, mode)
    return regions, report


__all__ = [
    "MANIFEST",
    "MODES",
    "VerifyReport",
    "algorithm_for",
    "check_index",
    "count_samples",
    "file_digests",
    "index_matches",
    "sha256_file",
    "shard_matches",
    "verify_region",
    "verify_split",
]
