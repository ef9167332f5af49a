"""Reading ``[egress] prices`` (USD per GB per region pair) from a plan or a ``--prices`` file.

    [egress.prices]
    "us-east-1>eu-west-1" = 0.02   # from > to
    "ap-southeast-1" = 0.09        # out of a region to any other

The plan loader refuses keys it does not know, so the table is taken out of the plan's TOML here
before the rest is validated as a plan (``split_plan``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError
from geoshard.plan.model import Plan, plan_from_dict
from geoshard.plan.names import check_region_name
from geoshard.plan.sniff import refuse_other_files
from geoshard.util import tomlfile

Prices = tuple[tuple[str, str, float], ...]


def parse_prices(table: Any, source: str) -> Prices:
    """``{"a>b": usd, "a": usd}`` → ((a, b, usd), (a, "*", usd)); one line naming the key when wrong."""
    if not isinstance(table, dict):
        raise ConfigError(f'{source}: egress.prices: must be a table of "FROM>TO" = USD per GB')
    out = []
    for key, usd in table.items():
        where = f"{source}: egress.prices.{key!r}"
        if isinstance(usd, bool) or not isinstance(usd, int | float) or not math.isfinite(usd) or not 0 <= usd <= 10:
            raise ConfigError(f"{where}: must be USD per GB, a number from 0 to 10, got {usd!r}")
        src, _, dst = key.partition(">")
        for name in (src, dst) if dst else (src,):
            check_region_name(name.strip(), where)
        out.append((src.strip(), dst.strip() or "*", float(usd)))
    return tuple(out)


def load_prices(path: Path) -> Prices:
    """A ``--prices`` file: a TOML file with an ``[egress.prices]`` table."""
    doc = tomlfile.loads(tomlfile.read_text(path, "prices"), str(path))
    unknown = set(doc) - {"egress"} or set(doc.get("egress", {})) - {"prices"}
    if unknown or "prices" not in doc.get("egress", {}):
        raise ConfigError(f"{path}: a prices file holds one [egress.prices] table; found {', '.join(sorted(unknown)) or 'none'}")
    return parse_prices(doc["egress"]["prices"], str(path))


def split_plan(path: Path) -> tuple[Plan, Prices]:
    """The plan, and its ``[egress] prices`` (empty when it has none)."""
    text = tomlfile.read_text(path, "plan")
    refuse_other_files(text, str(path))
    doc = tomlfile.loads(text, str(path))
    egress = doc.get("egress")
    prices: Prices = ()
    if isinstance(egress, dict) and "prices" in egress:
        prices = parse_prices(egress.pop("prices"), str(path))
        if not egress:
            doc.pop("egress")
    return plan_from_dict(doc, source=str(path), text=text), prices
