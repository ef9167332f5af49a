"""The model's constants: fitted by bench/simulate_bench.py's calibration set (never its
validation runs) on this project's machine under the WAN rehearsal; docs/simulate.md says how.

``REHEARSAL`` describes a run under ``geoshard train --wan`` here (the forwarder's ceiling, its
65,000-byte MTU); ``WAN`` is the same host costs on a real network path (1,500-byte MTU, no
forwarder): a projection, not checked against a real cross-region run.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError
from geoshard.sim.config import Constants
from geoshard.util import tomlfile

REHEARSAL = Constants(
    ceiling_mb_s=850.0,  # docs/benchmarks.md, wan_bench accuracy: 856 MB/s median at load 7-10
    mss=64_948,  # TUN MTU 65,000 - 52 bytes of IPv4 and TCP headers with timestamps
    trip_s=0.002,
    cpu_gflops=10.0,
    step_overhead_s=0.005,
    startup_s=1.5,
    request_s=0.01,
)

WAN = dataclasses.replace(REHEARSAL, ceiling_mb_s=None, mss=1448)


def load_constants(path: Path | None, base: Constants) -> Constants:
    """``base`` with the numbers of a ``[constants]`` TOML table (``--constants FILE``); one line naming a bad key."""
    if path is None:
        return base
    doc = tomlfile.loads(tomlfile.read_text(path, "constants"), str(path))
    table = doc.get("constants")
    if set(doc) != {"constants"} or not isinstance(table, dict):
        raise ConfigError(f"{path}: a constants file holds one [constants] table")
    known = {f.name: f for f in dataclasses.fields(Constants)}
    values: dict[str, Any] = {}
    for key, v in table.items():
        if key not in known or key == "tier_mb_s":
            raise ConfigError(f"{path}: constants.{key}: unknown key (known: {', '.join(k for k in known if k != 'tier_mb_s')})")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{path}: constants.{key}: must be a number >= 0, got {v!r}")
        values[key] = int(v) if key in ("mss", "init_cwnd", "gloo_threads", "outer_trips_before", "outer_trips_after") else float(v)
    return dataclasses.replace(base, **values)


def dump_constants(k: Constants) -> str:
    """The ``[constants]`` TOML of ``k`` (what load_constants reads)."""
    lines = ["[constants]"]
    for f in dataclasses.fields(Constants):
        v = getattr(k, f.name)
        if f.name != "tier_mb_s" and v is not None:
            lines.append(f"{f.name} = {v!r}")
    return "\n".join(lines) + "\n"
