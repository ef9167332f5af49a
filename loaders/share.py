"""Where a dataset's rank stands: its region (``resolve_region``) and its place in the region with
the job-wide samples per rank (``find_share``), from a topology, explicit figures, or a job that
sits in one region.
"""

from __future__ import annotations

from typing import Any

from geoshard.env import Environment
from geoshard.errors import ConfigError
from geoshard.loaders.balance import Balance, Remainder, balance
from geoshard.loaders.topology import RegionShare, Topology


def resolve_region(region: str | None, env: Environment) -> str:
    """``region=``, else GEOSHARD_REGION, else the AWS region variables."""
    r = region or env.geoshard_region or env.region
    if not r:
        raise ConfigError("no region: pass region=..., or set GEOSHARD_REGION (or AWS_REGION) to the region this node runs in")
    return r


def find_share(
    region: str,
    samples: int,
    topology: Topology | None,
    rank: int | None,
    size: int | None,
    samples_per_rank: int | None,
    remainder: Remainder,
) -> tuple[RegionShare, Balance | None]:
    """This rank's place in its region and the job-wide samples per rank (``samples``: the region's),
    with the job's balance where this rank agreed it (a topology without a given figure)."""
    if topology is not None:
        if samples_per_rank is not None:
            return topology.share(samples_per_rank), None
        found = _agree_balance(region, samples, topology, remainder)
        return topology.share(found.samples_per_rank), found
    if rank is None or size is None:
        job = _single_region_job(region)  # under torch.distributed: all ranks here, or an error
        rank, size = job if job is not None else (rank or 0, size or 1)
    return RegionShare(region, rank, size, samples_per_rank), None


def _agree_balance(region: str, samples: int, topology: Topology, remainder: Remainder) -> Balance:
    """The job's balance: this region's alone, or (collective) from every rank's region and counts."""
    size = topology.share().size
    if not topology.spans_regions:
        return balance({region: samples}, {region: size}, remainder)
    if not topology.live:
        raise ConfigError("a topology without process groups spans regions: pass samples_per_rank= as well")
    seen = {r: (n, k) for r, n, k in topology.all_gather((region, samples, size))}
    return balance({r: n for r, (n, _) in seen.items()}, {r: k for r, (_, k) in seen.items()}, remainder)


def _single_region_job(region: str) -> tuple[int, int] | None:
    """Under torch.distributed without a region group: the global rank and size, if every rank is in
    ``region``. A job that spans regions must say which ranks share this one (collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    topo = Topology.of(_gather_regions(region), dist.get_rank())
    if topo.spans_regions:
        raise ConfigError(
            f"this job's ranks span regions ({topo.describe()}): pass topology=Topology.discover(region) "
            "(or region_rank=, region_size= and samples_per_rank=) so each region's samples go to its own ranks"
        )
    return topo.rank, topo.world_size


def _gather_regions(region: str) -> list[str]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, region)
    return [str(r) for r in out]
