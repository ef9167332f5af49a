"""Manifests: the contract between split, sync, the loaders and users (docs/manifest.md).

``model`` holds the manifests and their readers, ``entry`` a shard's entry, ``table`` a region's
entries as columns, ``chunkindex`` the binary chunk index beside each shard (version 2),
``stream`` the parser that reads a manifest file piece by piece; ``verify`` re-hashes shards.
"""

from geoshard.manifest.entry import ShardChunks, ShardEntry
from geoshard.manifest.model import (
    MANIFEST,
    V2_FROM_SHARDS,
    VERSION,
    VERSIONS,
    Manifest,
    RegionManifest,
    RegionSummary,
    SourceEntry,
    check_relpath,
    default_version,
    dumps,
    parse_region_manifest,
    read_manifest,
    read_region_manifest,
    read_split_or_region,
)
from geoshard.manifest.table import ShardTable

__all__ = [
    "MANIFEST",
    "V2_FROM_SHARDS",
    "VERSION",
    "VERSIONS",
    "Manifest",
    "RegionManifest",
    "RegionSummary",
    "ShardChunks",
    "ShardEntry",
    "ShardTable",
    "SourceEntry",
    "check_relpath",
    "default_version",
    "dumps",
    "parse_region_manifest",
    "read_manifest",
    "read_region_manifest",
    "read_split_or_region",
]
