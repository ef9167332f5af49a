"""Whether the plan given to ``geoshard sync`` is the one the split was made with.

The split records its plan in ``DIR/manifest.json`` (the plan itself and the digest of what
decides shard contents: regions, weights, routing, shard size). Publishing a split under a plan
whose layout differs would put one plan's shares into buckets a loader reads with another's, so
sync refuses it before anything moves. Storage targets (bucket, endpoint, profile, Alluxio,
local, egress) may differ: the same shards may go elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError
from geoshard.manifest import Manifest
from geoshard.plan import Plan


def check_plan_matches(directory: Path, top: Manifest, plan: Plan) -> None:
    """ConfigError (exit 2) in one line saying what differs, when ``plan`` would lay the split out otherwise."""
    if not top.layout_sha256 or top.layout_sha256 == plan.layout_sha256():
        return  # a manifest without the digest predates it: nothing to compare against
    what = "; ".join(differences(top.plan, plan.to_dict())) or "routing or shard size differ"
    label = plan.path or "the plan"
    raise ConfigError(
        f"{label} does not match the split in {directory}: {what}; re-split with this plan "
        f"(geoshard split SOURCE... --plan {label} --out {directory} --replace) or sync with the plan the split was made with"
    )


def differences(split: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """What differs in layout between the split's recorded plan and the given one, as short phrases."""
    out = []
    old, new = split.get("regions", {}), given.get("regions", {})
    if only := [n for n in old if n not in new]:
        out.append(f"the split has region(s) {', '.join(only)} the plan lacks")
    if only := [n for n in new if n not in old]:
        out.append(f"the plan has region(s) {', '.join(only)} the split lacks")
    pairs = [(n, _weight(old, n), _weight(new, n)) for n in old if n in new]
    weights = [f"{n} {_num(a)} -> {_num(b)}" for n, a, b in pairs if a != b]
    if weights:
        out.append(f"weights differ (split -> plan: {', '.join(weights)})")
    for key in ("routing", "shards"):
        if split.get(key) != given.get(key):
            out.append(f"{key} differs (split {_flat(split.get(key))}, plan {_flat(given.get(key))})")
    return out


def _weight(regions: dict[str, Any], name: str) -> Any:
    r = regions[name]
    return r.get("weight") if isinstance(r, dict) else None  # the split's record is read as written


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else repr(v)


def _flat(d: Any) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))
