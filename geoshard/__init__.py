"""geoshard: region-local training data for multi-region PyTorch DDP.

``geoshard split`` re-shards a corpus by region, ``geoshard.loaders`` reads it back, region-local
first. See docs/architecture.md for how the parts fit.
"""

__version__ = "0.1.0"
