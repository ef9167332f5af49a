"""The region plan: which regions, their weights, buckets and routing (docs/plan.md).

``model`` loads and validates the TOML; ``routing`` decides which region a sample goes to.
"""

from geoshard.plan.model import (
    DEFAULT_SHARD_BYTES,
    POLICIES,
    Egress,
    Plan,
    Policy,
    Region,
    Routing,
    ShardTarget,
    load_plan,
    parse_plan,
    plan_from_dict,
)

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "POLICIES",
    "Egress",
    "Plan",
    "Policy",
    "Region",
    "Routing",
    "ShardTarget",
    "load_plan",
    "parse_plan",
    "plan_from_dict",
]
