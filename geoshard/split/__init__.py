"""``geoshard split``: re-shard a corpus by region as a Dask job."""

from geoshard.split.job import SplitResult, SplitSettings, run_split

__all__ = ["SplitResult", "SplitSettings", "run_split"]
