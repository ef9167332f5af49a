"""The plan TOML a proposal becomes: the input plan's routing, shards and buckets, the proposed
weights and each region's placement, with the ``geoshard train`` options of the chosen sync in
its header (the plan format has no sync keys). Checked by the plan's own loader before it is
written, and written atomically, never over a file without ``force``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError
from geoshard.optimize.inputs import OptimizeInputs
from geoshard.optimize.search import Proposal
from geoshard.plan.model import DEFAULT_SHARD_BYTES, parse_plan
from geoshard.util.fsutil import temp_file


def plan_doc(inputs: OptimizeInputs, proposal: Proposal, shard_bytes: int | None) -> dict[str, Any]:
    plan = inputs.plan
    doc: dict[str, Any] = plan.to_dict() if plan is not None else {}
    doc.setdefault("shards", {"bytes": DEFAULT_SHARD_BYTES, "samples": 0})
    if shard_bytes is not None:
        doc["shards"]["bytes"] = shard_bytes
    if doc.get("egress", {}).get("budget") is None:
        doc.get("egress", {}).pop("budget", None)
    had = doc.get("regions", {})
    regions: dict[str, dict[str, Any]] = {}
    for (name, weight), r in zip(proposal.weights, proposal.chosen.regions, strict=True):
        keep = {k: v for k, v in had.get(name, {}).items() if k in ("bucket", "endpoint", "profile")}
        entry: dict[str, Any] = {"weight": weight}
        p = r.placement
        if p.tier == "remote" and p.data_region is not None:
            donor = had[p.data_region]
            entry["bucket"] = f"{donor['bucket'].rstrip('/')}-{name}"  # a sibling of the source's prefix
            entry.update({k: donor[k] for k in ("endpoint", "profile") if k in donor})
        else:
            entry.update(keep)
        if p.tier == "local":
            entry["local"] = had.get(name, {}).get("local") or f"{inputs.local_root.rstrip('/')}/{name}"
        if p.tier == "alluxio":
            entry["alluxio"] = had[name]["alluxio"]
        regions[name] = entry
    doc["regions"] = regions
    return doc


def render_plan(inputs: OptimizeInputs, proposal: Proposal, header: list[str], shard_bytes: int | None = None) -> str:
    """The TOML text, checked by ``parse_plan`` (what geoshard split and train load)."""
    doc = plan_doc(inputs, proposal, shard_bytes)
    lines = [f"# {h}" for h in header]
    for section in ("routing", "shards", "egress"):
        if section in doc:
            lines += ["", f"[{section}]"] + [f"{k} = {_value(v)}" for k, v in doc[section].items() if not isinstance(v, dict)]
            for k, v in doc[section].items():
                if isinstance(v, dict):
                    lines += ["", f"[{section}.{k}]"] + [f"{_value(a)} = {_value(b)}" for a, b in v.items()]
    for name, entry in doc["regions"].items():
        lines += ["", f"[regions.{_value(name)}]"] + [f"{k} = {_value(v)}" for k, v in entry.items()]
    text = "\n".join(lines) + "\n"
    try:
        parse_plan(text, source="the proposed plan")
    except ConfigError as e:
        raise ConfigError(f"plan optimize: {e.message}") from e
    return text


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string: json's escapes are TOML's


def write_plan(path: Path, text: str, force: bool) -> None:
    """Atomically: a temporary file in the folder, then a rename (``force``) or a hard link that
    fails when ``path`` exists (never a half-written plan, never one overwritten unasked)."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"--out: {folder} is not a folder")
    if path.exists() and not force:
        raise ConfigError(f"--out: {path} exists; pass --force to replace it")
    fd, tmp = temp_file(folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise ConfigError(f"--out: {path} exists; pass --force to replace it") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
