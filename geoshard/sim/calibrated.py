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
    # The rehearsal's namespaces scale tcp_rmem's default with the MTU (wan/rehearsal.py
    # receive_buffer_for_mtu: 5,879,049 bytes at 65,000), so a new connection's window is half that,
    # and the sender's initial 10 x 64,948 bytes limits it, as on a real path (before 12-07 23:00:
    # the kernel's 131,072-byte buffer, a window of 65,536 bytes, one segment).
    init_rwnd=5_879_049 // 2,
    # Fitted by bench/simulate_bench.py on its calibration set C1-C10 on a quiet host (2026-12-07
    # 12:27-13:04, load < 2 through each run; `--refit` of bench/_data/sim1207c.json), with the
    # loader's new connections to another region's bucket, the start-up's crowding on this host's
    # cores, the S3 client a worker reading a bucket makes (sim/loader.py; with the shared service
    # model of geoshard/s3.py) and the samples' stored size; per unit of host slowdown (load / 2
    # cores, at least 1) where a constant is the host's (config.HOST_COSTS; fits at load 7.6-14.9
    # gave per-unit host costs of 0.5x to 4.5x quiet ones: load / 2 is a rough correction). The
    # built-in model's compute fits 39-69 GFLOPS on these cores (12-04's fit found none: its size
    # hid in the loop's and the sleep's time).
    bucket_s=0.00319,
    trip_s=0.0,
    hook_trip_s=0.01587,
    cpu_gflops=68.987,
    step_overhead_s=0.01869,  # once per optimizer step (not per micro-batch: predict.compute_s)
    s3_startup_s=0.0267,
    startup_s=0.017,
    host_cores=2,  # this machine's: every region's ranks and their loader workers share them
    batch_s=0.00051,
    store_request_s=0.309,
    store_byte_s=0.0,
    # The launch's stagger before the first DiLoCo round (C4 and C6: their median): every
    # region's processes start on this one shared host.
    startup_skew_s=9.1389,
    # The p2p round (sim/p2p.py) from C7, C8 and C10's round records (every region's rounds, their
    # phases): each pass the median seconds a value per unit of slowdown; groups 0 (made in round
    # 0, before the loop, and reused); p2p_fixed_s what the slowest region waited beyond the
    # model's terms in the rounds after the first (the regions' arrival skew: 0 this fit, 0.12-0.19
    # s before); the first round 1.26 s more than the later ones beyond the first batches' spread
    # (round 0 is a collective: no 9 s stagger). The MAC check and the gather have constants of
    # their own; since the pipeline (the gather and the outer step run as the sum lands) the
    # gather's fits 0-7e-9 s a value and the check is what is left after the transfer.
    p2p_prepare_value_s=3.255e-09,
    p2p_mac_value_s=2.451e-08,
    p2p_check_value_s=1.27e-08,
    p2p_step_value_s=1.383e-09,
    p2p_gather_value_s=6.878e-09,
    p2p_fixed_s=0.0,
    p2p_startup_skew_s=1.2615,
)

# A real network: 1,500-byte MTU, no forwarder, Linux's idle restart, 100 Gbit/s between the nodes
# of a region (an assumption, not a measurement). No launch stagger: the rehearsal's comes from
# starting every region's processes on one shared host, which regions on their own nodes do not.
WAN = dataclasses.replace(
    REHEARSAL,
    ceiling_mb_s=None,
    mss=1448,
    rto_min_s=0.2,
    local_mb_s=12_500.0,
    startup_skew_s=0.0,
    p2p_startup_skew_s=0.0,
    host_cores=0,
)


INT_KEYS = ("mss", "init_cwnd", "host_cores", "gloo_threads", "outer_trips_before", "outer_trips_after", "p2p_member_trips")


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
