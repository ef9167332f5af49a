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
    ceiling_mb_s=850.0,  # docs/benchmarks.md, wan_bench accuracy: 856 MB/s median at load 7-10 (a run passes its own)
    rto_min_s=10.0,  # the calibration set C1-C5 fits best with warm flows: no slow-start restart between steps here
    mss=64_948,  # TUN MTU 65,000 - 52 bytes of IPv4 and TCP headers with timestamps
    # Fitted by bench/simulate_bench.py on its calibration set C1-C6 (2026-12-04 15:50-16:26, load
    # 7.6-11.4 averaged through each run), per unit of host slowdown (load / 2 cores) where a
    # constant is the host's (config.HOST_COSTS): on these 2 shared cores the built-in model's size
    # does not show in its compute (cpu_gflops unbounded): a step's compute is mostly waiting for a core.
    bucket_s=0.00317,
    trip_s=0.0,
    hook_trip_s=0.00772,
    cpu_gflops=1e6,
    step_overhead_s=0.02537,
    startup_s=0.347,
    batch_s=0.00021,
    store_request_s=0.3805,
    store_byte_s=0.0,
    # The launch's stagger before the first DiLoCo round (C4 3.7 s, C6 10.3 s: their median): every
    # region's processes start on this one shared host.
    startup_skew_s=7.0283,
)

# A real network: 1,500-byte MTU, no forwarder, Linux's idle restart, 100 Gbit/s between the nodes
# of a region (an assumption, not a measurement). No launch stagger: the rehearsal's comes from
# starting every region's processes on one shared host, which regions on their own nodes do not.
WAN = dataclasses.replace(REHEARSAL, ceiling_mb_s=None, mss=1448, rto_min_s=0.2, local_mb_s=12_500.0, startup_skew_s=0.0)


INT_KEYS = ("mss", "init_cwnd", "gloo_threads", "outer_trips_before", "outer_trips_after", "p2p_member_trips")


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
        values[key] = int(v) if key in INT_KEYS else float(v)
    return dataclasses.replace(base, **values)


def dump_constants(k: Constants) -> str:
    """The ``[constants]`` TOML of ``k`` (what load_constants reads)."""
    lines = ["[constants]"]
    for f in dataclasses.fields(Constants):
        v = getattr(k, f.name)
        if f.name != "tier_mb_s" and v is not None:
            lines.append(f"{f.name} = {v!r}")
    return "\n".join(lines) + "\n"
