"""The order of the regions around the exchange's rings, from a WAN matrix.

A ring all-reduce is as fast as its slowest link: among the cyclic orders of the regions, take the
one whose slowest link has the most bandwidth, ties broken by the least total one-way latency
around the ring. Up to ``EXHAUSTIVE`` regions every cyclic order is tried ((n-1)!/2 distinct
rings: 2,520 for 8); beyond, a greedy ring (from the first region, always the widest, then
nearest, next link). Without a matrix the ring is the job's order. Pure: the caller turns its
matrix into ``links``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

EXHAUSTIVE = 8

# (bandwidth in bytes/s, None: uncapped; one-way latency in ms) per unordered pair of regions.
Links = Mapping[frozenset[str], tuple[float | None, float]]


def _cost(order: Sequence[str], links: Links) -> tuple[float, float]:
    """(minus the slowest link's bandwidth, total latency): smaller is better."""
    pairs = [frozenset((a, b)) for a, b in zip(order, [*order[1:], order[0]], strict=True)]
    slowest = min(_width(links[p][0]) for p in pairs)
    return -slowest, sum(links[p][1] for p in pairs)


def ring_order(regions: Sequence[str], links: Links | None) -> tuple[str, ...]:
    """``regions`` in ring order (the first region stays first); the job's order without ``links``."""
    regions = tuple(regions)
    if links is None or len(regions) <= 3:  # 3 regions or fewer: every order is the same ring
        return regions
    missing = [f"{a}-{b}" for a, b in itertools.combinations(regions, 2) if frozenset((a, b)) not in links]
    if missing:
        return regions  # a matrix of other regions: no order to prefer
    if len(regions) <= EXHAUSTIVE:
        first, rest = regions[0], regions[1:]
        return min(((first, *p) for p in itertools.permutations(rest)), key=lambda o: (_cost(o, links), o))
    order = [regions[0]]
    left = list(regions[1:])
    while left:
        here = order[-1]
        nxt = min(left, key=lambda g: (*_cost_of_link(links[frozenset((here, g))]), regions.index(g)))
        order.append(nxt)
        left.remove(nxt)
    return tuple(order)


def _cost_of_link(link: tuple[float | None, float]) -> tuple[float, float]:
    return (-_width(link[0]), link[1])


def _width(bandwidth: float | None) -> float:
    return math.inf if bandwidth is None else float(bandwidth)


def restrict(ring: Sequence[str], members: Sequence[str]) -> tuple[str, ...]:
    """A round's members in the job's ring order (a missing region is skipped)."""
    return tuple(g for g in ring if g in members)
