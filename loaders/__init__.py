"""geoshard.loaders: region-aware PyTorch datasets over geoshard manifests.

Installed from the top-level ``loaders/`` folder as ``geoshard.loaders``. It shares only the
plan, the manifest, the formats and the retry policy with the rest of geoshard (no Dask, click
or sync code)::

    from geoshard.loaders import RegionalDataset, make_loader, timed

    loader = make_loader("plan.toml", region="eu-west-1", batch_size=64, num_workers=2, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in timed(loader):
            ...
"""

from geoshard.loaders.chain import AllTiersFailed, ChainSettings, TierChain, build_chain
from geoshard.loaders.dataset import RegionalDataset
from geoshard.loaders.loader import RegionalLoader, Timed, make_loader, timed

from geoshard.manifest import RegionManifest, ShardEntry, read_region_manifest
from geoshard.plan import Plan, load_plan

__all__ = [
    "AllTiersFailed",
    "ChainSettings",
    "Plan",
    "RegionManifest",
    "RegionalDataset",
    "RegionalLoader",
    "ShardEntry",
    "TierChain",
    "Timed",
    "build_chain",
    "load_plan",
    "make_loader",
    "read_region_manifest",
    "timed",
]
