"""Deterministic grouping of sources into Dask tasks.

Groups depend only on the sources and the plan, never on the worker count, which is what makes
the output byte-identical whatever the cluster looks like. Each group writes its own shards per
region, so a group is sized to fill about one target-sized shard in its smallest region.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from geoshard.plan import Plan
from geoshard.split.sources import SourceRef

MIN_GROUPS = 8  # enough tasks to keep a small cluster busy on a mid-sized corpus


def group_bytes(plan: Plan, total: int) -> int:
    target = plan.shards.bytes
    weights = [r.weight for r in plan.regions]
    if plan.routing.policy == "replicate":
        spread = 1.0
    elif plan.routing.policy == "hash":
        spread = sum(weights) / min(weights)
    else:
        spread = float(len(weights))
    return max(target, min(int(target * spread), math.ceil(total / MIN_GROUPS)))


def make_groups(refs: Sequence[SourceRef], plan: Plan) -> list[tuple[SourceRef, ...]]:
    limit = group_bytes(plan, sum(r.size for r in refs))
    groups: list[tuple[SourceRef, ...]] = []
    current: list[SourceRef] = []
    size = 0
    for ref in refs:
        if current and size + ref.size > limit:
            groups.append(tuple(current))
            current, size = [], 0
        current.append(ref)
        size += ref.size
    if current:
        groups.append(tuple(current))
    return groups
