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

Names are imported on first use, so ``import geoshard.loaders`` stays cheap (torch and boto3
load when a dataset or tier is made).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geoshard.loaders.chain import AllTiersFailed, ChainSettings, TierChain, build_chain
    from geoshard.loaders.dataset import RegionalDataset
    from geoshard.loaders.decode import Label, Raw, TensorSpec
    from geoshard.loaders.elastic import region_states
    from geoshard.loaders.loader import RegionalLoader, Timed, make_loader, timed
    from geoshard.manifest import RegionManifest, ShardEntry, read_region_manifest
    from geoshard.plan import Plan, load_plan

_WHERE = {
    "AllTiersFailed": "geoshard.loaders.chain",
    "ChainSettings": "geoshard.loaders.chain",
    "TierChain": "geoshard.loaders.chain",
    "build_chain": "geoshard.loaders.chain",
    "RegionalDataset": "geoshard.loaders.dataset",
    "Label": "geoshard.loaders.decode",
    "Raw": "geoshard.loaders.decode",
    "TensorSpec": "geoshard.loaders.decode",
    "region_states": "geoshard.loaders.elastic",
    "RegionalLoader": "geoshard.loaders.loader",
    "Timed": "geoshard.loaders.loader",
    "make_loader": "geoshard.loaders.loader",
    "timed": "geoshard.loaders.loader",
    "RegionManifest": "geoshard.manifest",
    "ShardEntry": "geoshard.manifest",
    "read_region_manifest": "geoshard.manifest",
    "Plan": "geoshard.plan",
    "load_plan": "geoshard.plan",
}
__all__ = [
    "AllTiersFailed",
    "ChainSettings",
    "Label",
    "Plan",
    "Raw",
    "RegionManifest",
    "RegionalDataset",
    "RegionalLoader",
    "ShardEntry",
    "TensorSpec",
    "TierChain",
    "Timed",
    "build_chain",
    "load_plan",
    "make_loader",
    "read_region_manifest",
    "region_states",
    "timed",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
