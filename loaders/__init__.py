"""geoshard.loaders: region-aware PyTorch datasets over geoshard manifests.

Installed from the top-level ``loaders/`` folder as ``geoshard.loaders``. It shares only the
plan, the manifest and the formats with the rest of geoshard (no Dask, click or sync code).
The tier chain and ``RegionalDataset`` arrive with the loaders issue; today it exposes the
manifest readers training code needs to list its region's shards.
"""

from geoshard.manifest import RegionManifest, ShardEntry, read_region_manifest
from geoshard.plan import Plan, load_plan

__all__ = ["Plan", "RegionManifest", "ShardEntry", "load_plan", "read_region_manifest"]
