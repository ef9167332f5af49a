"""Where the ranks of a job sit: the rank → region map, each region's ranks, one process group per
region and one group of region leaders.

A job whose ranks span regions splits each region's samples among that region's ranks only, and
reduces gradients inside a region before the region leaders exchange them over the long links.
``Topology.discover(region)`` learns every rank's region with one all-gather; ``Topology.of``
builds the same object from a list (tests, tools, a single process). ``RegionShare`` is the part
a dataset needs: plain data that crosses into DataLoader workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geoshard.errors import ConfigError


@dataclass(frozen=True)
class RegionShare:
    """A rank's place in its region, and the job-wide samples per rank (``None``: this region alone decides)."""

    region: str
    rank: int  # within the region
    size: int  # ranks in the region
    samples_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"region rank {self.rank} is outside the region's {self.size} rank(s)")
        if self.samples_per_rank is not None and self.samples_per_rank < 0:
            raise ConfigError(f"samples_per_rank must be 0 or more, got {self.samples_per_rank}")


RegionsAgree = Callable[[int | None, int | None], int | None]


@dataclass(frozen=True)
class Topology:
    rank: int
    regions: tuple[str, ...]  # the region of every global rank
    # Process groups exist only in a live job (``discover``); the map alone is enough everywhere else.
    region_group: Any = field(default=None, compare=False, repr=False)
    leader_group: Any = field(default=None, compare=False, repr=False)
    # A job whose worlds do not span its regions (DiLoCo: one world a region): what every region has
    # published, agreed by the trainer's side channel. Called on the region leader only, with the
    # region's newest and the epoch being decided (None: the pin at start); returns what it reads.
    regions_agree: RegionsAgree | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.regions):
            raise ConfigError(f"rank {self.rank} is outside the job's {len(self.regions)} rank(s)")

    @classmethod
    def of(cls, regions: Sequence[str], rank: int = 0) -> Topology:
        return cls(rank=rank, regions=tuple(regions))

    @classmethod
    def discover(cls, region: str) -> Topology:
        """Collective: every rank calls it with its own region; builds the region and leader groups."""
        import torch.distributed as dist

        world = dist.get_world_size()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, region)
        topo = cls.of([str(r) for r in gathered], dist.get_rank())
        # new_group is collective over the whole world: every rank creates every group, in one order.
        region_group = None
        for name in topo.region_names:
            g = dist.new_group(list(topo.ranks_of(name)))
            if name == topo.region:
                region_group = g
        leader_group = dist.new_group(list(topo.leaders))
        return cls(rank=topo.rank, regions=topo.regions, region_group=region_group, leader_group=leader_group)

    # -- the map ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.regions)

    @property
    def region(self) -> str:
        return self.regions[self.rank]

    @property
    def region_names(self) -> tuple[str, ...]:
        """Regions in the order of their first rank."""
        return tuple(dict.fromkeys(self.regions))

    def ranks_of(self, region: str) -> tuple[int, ...]:
        return tuple(r for r, name in enumerate(self.regions) if name == region)

    @property
    def region_ranks(self) -> Mapping[str, tuple[int, ...]]:
        return {name: self.ranks_of(name) for name in self.region_names}

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest global rank of each region: the ranks that talk across regions."""
        return tuple(self.ranks_of(name)[0] for name in self.region_names)

    @property
    def leader(self) -> int:
        return self.ranks_of(self.region)[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def region_rank(self) -> int:
        return self.ranks_of(self.region).index(self.rank)

    @property
    def region_size(self) -> int:
        return len(self.ranks_of(self.region))

    @property
    def spans_regions(self) -> bool:
        return len(self.region_names) > 1

    @property
    def live(self) -> bool:
        return self.region_group is not None

    def share(self, samples_per_rank: int | None = None) -> RegionShare:
        return RegionShare(self.region, self.region_rank, self.region_size, samples_per_rank)

    def all_gather(self, obj: Any) -> list[Any]:
        """Collective over the job: every rank's ``obj``, by global rank."""
        import torch.distributed as dist

        if not self.live:
            raise ConfigError("this topology has no process groups; build it with Topology.discover(region) inside the job")
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def describe(self) -> str:
        return ", ".join(f"{name}: {len(ranks)} rank(s)" for name, ranks in self.region_ranks.items())
