"""The region plan: which regions, their weights, buckets and routing (docs/plan.md).

``model`` loads and validates the TOML; ``routing`` decides which region a sample goes to;
``names`` is the one region-name rule.
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
from geoshard.plan.names import check_region_name, is_region_name

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "POLICIES",
    "Egress",
    "Plan",
    "Policy",
    "Region",
    "Routing",
    "ShardTarget",
    "check_region_name",
    "is_region_name",
    "load_plan",
    "parse_plan",
    "plan_from_dict",
]
