"""The rank's context: who and where this process is in the job, built once at start-up and passed
down (rank, local rank, region, the region topology with its process groups, device, backend).

Under DiLoCo each region is its own torch.distributed world; ``rank`` and ``world_size`` are then
the job's (the region's offset in ``--outer-regions`` plus the rank in the region), and
``group_rank`` / ``group_size`` the process group's, which collectives use."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from geoshard.env import read_environment
from geoshard.errors import ConfigError
from geoshard.loaders.dataset import resolve_region
from geoshard.loaders.topology import Topology
from geoshard.trainer.config import RegionRanks


@dataclass(frozen=True)
class RankContext:
    rank: int
    local_rank: int
    world_size: int
    topology: Topology
    device: torch.device
    backend: str
    group_rank: int = 0  # in the process group (== rank unless each region is its own world)
    group_size: int = 1

    @property
    def region(self) -> str:
        return self.topology.region

    @classmethod
    def discover(
        cls, region: str | None, backend: str, environ: Mapping[str, str] | None = None, job: tuple[RegionRanks, ...] = ()
    ) -> RankContext:
        """Collective (the process group must be up): learns every rank's region and builds the groups.
        ``job``: the regions of a job whose regions are separate worlds (DiLoCo), in job order."""
        env = os.environ if environ is None else environ
        local_rank = int(env.get("LOCAL_RANK", "0"))
        topology = Topology.discover(resolve_region(region, read_environment(env)))
        device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
        offset, job_world = 0, world
        if job:
            names = [r.region for r in job]
            if topology.spans_regions or topology.region not in names:
                raise ConfigError(f"--outer-regions {','.join(names)}: this torchrun's ranks are in {', '.join(topology.region_names)}")
            mine = job[names.index(topology.region)]
            if mine.nproc != world:
                raise ConfigError(f"--outer-regions gives {mine.region} {mine.nproc} rank(s); its torchrun has {world}")
            offset = sum(r.nproc for r in job[: names.index(topology.region)])
            job_world = sum(r.nproc for r in job)
        return cls(offset + rank, local_rank, job_world, topology, device, backend, rank, world)
