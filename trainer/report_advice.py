"""What to try when a verdict of the report is "not met": one line each, from the run's own figures.

``advise(report)`` reads the dict ``report.summarize`` builds and returns the ``advice`` part of
report.json: for the IO-wait budget (including a wait that is mostly the first batch), the
compute utilization target and the egress budget, a line saying what to change, or None when
the verdict is met. The lines name the option to change and a value computed from the measured
times per step, so the user does not have to derive it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from geoshard.loaders.stats import StatsSnapshot
from geoshard.util.units import human_bytes

_CLOSE = 0.05  # an unreachable target: exchanges cost at most this share of a step's other time


def advise(r: Mapping[str, Any]) -> dict[str, str | None]:
    return {"io_wait": _io_wait(r), "utilization": _utilization(r), "egress": _egress(r)}


def _per_step(r: Mapping[str, Any], key: str) -> float:
    """Seconds of breakdown part ``key`` per step and rank."""
    steps = r["steps"] * max(1, len(r["ranks"]))
    return r["breakdown"][key]["seconds"] / steps if steps else 0.0


def _io_wait(r: Mapping[str, Any]) -> str | None:
    return None if r["within_budget"] else _less_wait(r)


def _less_wait(r: Mapping[str, Any]) -> str:
    budget, after = r["budget"], r["io_wait_share_after_first_batch"]
    if after <= budget:
        return (
            f"the first batch ({_s(r['time_to_first_batch_s'] or 0.0)}) is most of the wait: "
            f"after it IO wait is {after:.1%}, within budget; "
            "fill the local replica before training (geoshard pull) or train longer"
        )
    crossed = r["cross_region_data_bytes"]
    if crossed:
        return (
            f"{human_bytes(crossed)} came from other regions' buckets: give each region its own copy "
            "(a region in the plan, then geoshard sync) or pull those shards to the local replica first (geoshard pull)"
        )
    wait, compute = _per_step(r, "data_wait"), _per_step(r, "compute")
    return (
        f"data wait {_s(wait)} per step against {_s(compute)} compute, all from the rank's own region: "
        "more loader workers (--num-workers) or a deeper prefetch (--prefetch)"
    )


def _utilization(r: Mapping[str, Any]) -> str | None:
    u = r.get("utilization")
    if not u or u["met"]:
        return None
    b, target = r["breakdown"], u["target"]
    losses = {k: b[k]["share"] for k in ("data_wait", "checkpoint", "outer_sync", "other") if k in b}
    if r.get("grad_sync_measured", True):
        losses["comm"] = b["comm"]["share"]
    worst = max(losses, key=lambda k: losses[k])
    share = losses[worst]
    if worst == "comm":
        return _fewer_exchanges(r, target)
    if worst == "data_wait":
        # Over the IO-wait budget too: its own line says what to try.
        return f"data wait is {share:.1%} of the wall: " + ("see the IO-wait line" if not r["within_budget"] else _less_wait(r))
    if worst == "outer_sync":
        return (
            f"DiLoCo's outer rounds are {share:.1%} of the wall: rounds less often (a larger --outer-steps) "
            "or exchanged behind training (--outer-overlap)"
        )
    if worst == "checkpoint":
        return f"checkpoints are {share:.1%} of the wall: a larger --checkpoint-every"
    note = (
        "" if r.get("grad_sync_measured", True) else " (gradient sync not measured: StepLog cannot see DDP's all-reduce, it is in compute)"
    )
    return f"{share:.1%} of the wall is outside data wait, compute and checkpoints{note}: look at what the loop does between steps"


def _fewer_exchanges(r: Mapping[str, Any], target: float) -> str:
    """Gradient sync is the largest loss: exchange every k steps, with k from the measured times."""
    sync = _per_step(r, "comm")
    compute = _per_step(r, "compute") - sync
    rest = _per_step(r, "data_wait") + _per_step(r, "checkpoint") + _per_step(r, "other")
    share = r["breakdown"]["comm"]["share"]
    head = f"gradient sync is {share:.1%} of the wall ({_s(sync)} per step against {_s(compute)} of compute)"
    # One exchange per k steps: utilization k*c / (k*(c + rest) + sync) reaches the target when
    # k >= target*sync / (c - target*(c + rest)). When the rest alone keeps it under the target,
    # k makes the exchange 5% of a step's other time: about as close as exchanges can bring it.
    room = compute - target * (compute + rest)
    k = _round_up(target * sync / room if room > 0 else sync / (_CLOSE * (compute + rest)))
    reach = k * compute / (k * (compute + rest) + sync)
    if len(r.get("regions") or {}) > 1:
        change = (
            f"DiLoCo across the regions (--sync diloco --outer-steps {k}, with --outer-overlap), "
            f"or {k}x the micro-batches per exchange (--accum-steps)"
        )
    else:
        change = f"{k}x the micro-batches per exchange (--accum-steps), or fp16 gradients (--grad-compression fp16)"
    if room > 0:
        return f"{head}: {change}"
    return f"{head}: {change}, for about {reach:.0%} utilization; data wait, checkpoints and the rest keep it under {target:.0%}"


def _egress(r: Mapping[str, Any]) -> str | None:
    budget, most = r.get("egress_budget_bytes"), r.get("egress_bytes_max_rank", 0)
    if not budget or most <= budget:
        return None
    sources = sorted({pair.source for pair in StatsSnapshot.from_dict(r, "the report").egress})
    return (
        f"one rank read {human_bytes(most)} from {', '.join(sources)}, {most / budget:.0%} of the budget: "
        "sync those shards to the reading region (or pull them to its local replica), or raise egress.budget"
    )


def _round_up(x: float) -> int:
    """A step count people type: 1-2 significant digits, rounded up."""
    n = max(1, math.ceil(x))
    if n < 20:
        return n
    scale = 10 ** (len(str(n)) - 2)
    return math.ceil(n / scale) * scale


def _s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
