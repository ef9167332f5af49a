"""Which rank owns which part of the flat parameter vector in the peer-to-peer exchange.

The vector is cut into ``S`` shards, ``S`` the most ranks any region of the job has; in a region
of ``n`` ranks, in-region rank ``k`` owns the shards ``s`` with ``s % n == k``. Every region then
has exactly one owner of every shard (the cross-region group of shard ``s`` has one rank per
member region), and a rank of a smaller region owns several shards: with us-east-1:3 and
eu-west-1:2, S = 3, eu-west-1's rank 0 owns shards 0 and 2, its rank 1 shard 1. ``S`` is fixed by
the job's regions, not by a round's members, so a region leaving or rejoining never moves outer
state between the ranks of a region.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from geoshard.errors import ConfigError

if TYPE_CHECKING:
    import torch


def shard_count(ranks_per_region: Sequence[int]) -> int:
    """S: the most ranks any region has."""
    if not ranks_per_region or min(ranks_per_region) < 1:
        raise ConfigError(f"every region needs at least one rank, got {list(ranks_per_region)}")
    return max(ranks_per_region)


def owned(k: int, n: int, shards: int) -> tuple[int, ...]:
    """The shards in-region rank ``k`` of a region of ``n`` ranks owns."""
    if not 0 <= k < n:
        raise ConfigError(f"in-region rank {k} is not in a region of {n} rank(s)")
    return tuple(range(k, shards, n))


def owner(s: int, n: int) -> int:
    """The in-region rank that owns shard ``s`` in a region of ``n`` ranks."""
    return s % n


def span(numel: int, shards: int, s: int) -> tuple[int, int]:
    """Shard ``s``'s [start, stop) in a flat vector of ``numel`` values: sizes differ by at most one."""
    base, extra = divmod(numel, shards)
    start = s * base + min(s, extra)
    return start, start + base + (1 if s < extra else 0)


@dataclass(frozen=True)
class Layout:
    """One rank's place in the sharded exchange: its region's size, its rank there, the job's S."""

    numel: int
    shards: int  # S
    n: int  # ranks in this rank's region
    k: int  # this rank's in-region rank

    @property
    def mine(self) -> tuple[int, ...]:
        return owned(self.k, self.n, self.shards)

    def span(self, s: int) -> tuple[int, int]:
        return span(self.numel, self.shards, s)

    @property
    def own_numel(self) -> int:
        """Values this rank keeps of the outer state (about numel / n)."""
        return sum(b - a for a, b in map(self.span, self.mine))

    def offsets(self) -> dict[int, int]:
        """Where each owned shard starts in this rank's own vector (its shards concatenated in
        ``mine`` order), by shard, in ``mine`` order."""
        out, i = {}, 0
        for s in self.mine:
            a, b = self.span(s)
            out[s], i = i, i + b - a
        return out

    def by_shard(self, own: torch.Tensor) -> dict[int, torch.Tensor]:
        """This rank's owned shards concatenated (``own``: its outer parameters, momentum or residual)
        cut back into each shard's part, by shard: views, in ``mine`` order."""
        assert own.numel() == self.own_numel, (own.numel(), self.own_numel)
        return {s: own[i : i + b - a] for s, i in self.offsets().items() for a, b in [self.span(s)]}
