"""Manifests: the contract between split, sync, the loaders and users (docs/manifest.md).

``model`` holds the records and their readers; ``verify`` re-hashes shards against them.
"""

from geoshard.manifest.model import (
    MANIFEST,
    VERSION,
    Manifest,
    RegionManifest,
    RegionSummary,
    ShardChunks,
    ShardEntry,
    SourceEntry,
    check_relpath,
    dumps,
    parse_region_manifest,
    read_manifest,
    read_region_manifest,
    read_split_or_region,
)

__all__ = [
    "MANIFEST",
    "VERSION",
    "Manifest",
    "RegionManifest",
    "RegionSummary",
    "ShardChunks",
    "ShardEntry",
    "SourceEntry",
    "check_relpath",
    "dumps",
    "parse_region_manifest",
    "read_manifest",
    "read_region_manifest",
    "read_split_or_region",
]
