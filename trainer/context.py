"""The rank's context: who and where this process is in the job, built once at start-up and passed
down (rank, local rank, region, the region topology with its process groups, device, backend)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from geoshard.loaders.dataset import resolve_region
from geoshard.loaders.topology import Topology

from geoshard.env import read_environment


@dataclass(frozen=True)
class RankContext:
    rank: int
    local_rank: int
    world_size: int
    topology: Topology
    device: torch.device
    backend: str

    @property
    def region(self) -> str:
        return self.topology.region

    @classmethod
    def discover(cls, region: str | None, backend: str, environ: Mapping[str, str] | None = None) -> RankContext:
        """Collective (the process group must be up): learns every rank's region and builds the groups."""
        env = os.environ if environ is None else environ
        local_rank = int(env.get("LOCAL_RANK", "0"))
        topology = Topology.discover(resolve_region(region, read_environment(env)))
        device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
        return cls(dist.get_rank(), local_rank, dist.get_world_size(), topology, device, backend)
