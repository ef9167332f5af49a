"""A rank's number in a job that spans regions, from stable facts only: the job's region order and
the rank's place in its region.

torchrun's c10d rendezvous numbers its agents by their sorted (address, pid): on one machine that
is the order the agents happened to start in, under the WAN rehearsal the string order of their
addresses, and on real nodes whatever the hosts are called. The global rank decides which rank
is 0 (whose parameters DDP broadcasts, who writes the checkpoint and the report), the order of
every all-reduce's sum, and the files a rank writes. ``geoshard train --regions`` passes the job's
``REGION:RANKS,...`` as ``--rank-order``; each rank then takes the number
``offset of its region + LOCAL_RANK`` and joins the process group with it, so two launches of one
job number their ranks alike whatever order the agents met in. The rendezvous itself is
untouched (c10d, for restarts: trainer/launch.py), and so is which process serves the process
group's store (torchrun's rank 0, at the MASTER_ADDR torchrun gave every rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from geoshard.errors import ConfigError
from geoshard.trainer.config import RegionRanks


def job_rank(order: Sequence[RegionRanks], region: str, local_rank: int, local_world: int, world: int) -> int:
    """The rank's number in ``order``; a ConfigError when torchrun's world does not match it."""
    names = [r.region for r in order]
    spec = ",".join(f"{r.region}:{r.nproc}" for r in order)
    if region not in names:
        raise ConfigError(f"--rank-order {spec}: this rank's region {region} is not one of them")
    if sum(r.nproc for r in order) != world:
        raise ConfigError(f"--rank-order {spec} counts {sum(r.nproc for r in order)} rank(s); torchrun started {world}")
    i = names.index(region)
    # One agent per region: its local ranks are the region's ranks. Several agents in one region
    # would need their node rank too, which c10d hands out in arrival order.
    if local_world != order[i].nproc or not 0 <= local_rank < local_world:
        raise ConfigError(
            f"--rank-order {spec} gives {region} {order[i].nproc} rank(s); its torchrun agent has {local_world} "
            "(one agent per region: leave --rank-order out with several agents in a region)"
        )
    return sum(r.nproc for r in order[:i]) + local_rank


def job_rank_from(order: Sequence[RegionRanks], region: str | None, environ: Mapping[str, str], world: int) -> int:
    """``job_rank`` with the region (``--region``, else GEOSHARD_REGION, else AWS_REGION) and the
    local rank and agent size from torchrun's variables."""
    from geoshard.env import read_environment
    from geoshard.loaders.dataset import resolve_region

    try:
        local_rank, local_world = int(environ["LOCAL_RANK"]), int(environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"--rank-order: run the trainer under torchrun: {e} is missing or not a number in its environment") from e
    return job_rank(order, resolve_region(region, read_environment(environ)), local_rank, local_world, world)
