"""Composes the model's parts into one ``Prediction`` whose fields carry report.json's names.

Per rank and optimizer step: compute = the model's forward and backward (6 x params x samples
flops at ``cpu_gflops``) + ``--step-time`` + the loop's own ``step_overhead_s`` per step; then the gradient
exchange (grad.py), the IO wait after the first batch (loader.py), checkpoints, and under DiLoCo
the rounds' waits (outer.py) spread over their H steps. A rank's wall time is the first batch plus
its steps; utilization is compute over wall, as report.json computes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from geoshard.sim import cost, grad, outer
from geoshard.sim.config import SimConfig
from geoshard.sim.loader import region_loader


@dataclass(frozen=True)
class RegionPrediction:
    name: str
    ranks: int
    time_to_first_batch_s: float
    io_wait_share_after_first_batch: float
    tier: str
    tier_bytes: float
    cross_region_data_bytes: float


@dataclass(frozen=True)
class Prediction:
    """A run predicted; the names are report.json's (``to_report`` gives its JSON layout)."""

    sync: str
    steps: int
    world_size: int
    samples: int
    utilization: float  # compute (without gradient exchange) over wall, over ranks
    grad_sync_s_per_step: float
    cross_region_grad_bytes_per_step: float
    io_wait_share_after_first_batch: float
    time_to_first_batch_s: float
    step_s: float  # wall per optimizer step after the first batch, outer rounds included
    compute_s_per_step: float
    outer_round_count: int
    outer_round_s: float  # one round's exchange, before overlap
    outer_sync_s_mean: float  # what the job waits per round (report.json's outer.sync_s_mean)
    outer_bytes: float  # over all rounds (report.json's outer.bytes)
    outer_calibrated: bool
    outer_phases: tuple[tuple[str, float], ...]  # p2p: one round's seconds per phase (the round records' names)
    cross_region_data_bytes: float
    regions: tuple[RegionPrediction, ...]
    pair_bytes: tuple[tuple[str, str, float], ...]  # (from, to, bytes over the run)
    egress_usd: tuple[tuple[str, str, float], ...]  # (from, to, USD over the run)

    @property
    def egress_usd_total(self) -> float:
        return sum(x for _, _, x in self.egress_usd)

    def to_report(self) -> dict[str, Any]:
        """report.json's layout for the fields the model predicts, plus the egress table."""
        usd = {(a, b): x for a, b, x in self.egress_usd}
        return {
            "sync": self.sync,
            "steps": self.steps,
            "world_size": self.world_size,
            "samples": self.samples,
            "utilization": {"share": _r(self.utilization)},
            "grad_sync_s_per_step": _r(self.grad_sync_s_per_step),
            "cross_region_grad_bytes_per_step": _r(self.cross_region_grad_bytes_per_step),
            "cross_region_grad_bytes": _r(self.cross_region_grad_bytes_per_step * self.steps),
            "cross_region_data_bytes": round(self.cross_region_data_bytes),
            "io_wait_share_after_first_batch": _r(self.io_wait_share_after_first_batch),
            "time_to_first_batch_s": _r(self.time_to_first_batch_s),
            "step_s": _r(self.step_s),
            "outer": None
            if self.sync != "diloco"
            else {
                "round_count": self.outer_round_count,
                "sync_s_mean": _r(self.outer_sync_s_mean),
                "round_s": _r(self.outer_round_s),
                "bytes": round(self.outer_bytes),
                "calibrated": self.outer_calibrated,
                **({"phases": {k: _r(v) for k, v in self.outer_phases}} if self.outer_phases else {}),
            },
            "regions": {
                g.name: {
                    "ranks": g.ranks,
                    "time_to_first_batch_s": _r(g.time_to_first_batch_s),
                    "io_wait_share_after_first_batch": _r(g.io_wait_share_after_first_batch),
                    "tier_bytes": {g.tier: round(g.tier_bytes)},
                    "cross_region_data_bytes": round(g.cross_region_data_bytes),
                }
                for g in self.regions
            },
            "egress": [{"from": a, "to": b, "bytes": round(n), "usd": round(usd.get((a, b), 0.0), 4)} for a, b, n in self.pair_bytes],
            "egress_usd": round(self.egress_usd_total, 4),
        }


def compute_s(cfg: SimConfig) -> float:
    """One optimizer step's compute on one rank, without any exchange: the micro-batches' flops,
    ``--step-time`` once (the trainer sleeps it once per optimizer step, trainer/loop.py) and
    ``step_overhead_s`` once. The overhead was modelled per micro-batch until the accumulation
    runs (C3, V2, V3, V9 of simulate_bench) showed it is not: on this loaded host a step's
    overhead is its wait for a core, once a step; per micro-batch they were predicted 1.3-1.9x
    their utilization."""
    k = cfg.constants
    samples = cfg.batch_size * cfg.accum_steps
    return 6 * cfg.params * samples / (k.cpu_gflops * 1e9) + cfg.step_time + k.step_overhead_s


def predict(cfg: SimConfig) -> Prediction:
    cfg = dataclasses.replace(cfg, constants=cfg.constants.on_host())
    k = cfg.constants
    compute = compute_s(cfg)
    exchange = grad.mean_exchange(cfg, idle_s=compute)  # the links idle while the ranks compute
    checkpoint = (cfg.steps // cfg.checkpoint_every) * (k.checkpoint_s + 8 * cfg.params / (k.local_mb_s * 1e6)) / cfg.steps
    busy = compute + exchange.seconds + checkpoint
    loaders = [region_loader(cfg, r, busy) for r in cfg.regions]
    wait = max(x.io_wait_s_per_step for x in loaders)
    step = busy + wait
    rnd = outer.exchange_round(cfg) if cfg.sync == "diloco" else outer.OuterRound(0.0, 0.0, ())
    rounds = cfg.steps // cfg.outer_steps if cfg.sync == "diloco" and len(cfg.regions) > 1 else 0
    skew = outer.startup_skew_s([x.time_to_first_batch_s for x in loaders], cfg)
    round_wait = outer.mean_round_wait_s(rnd.seconds, cfg, step, skew + rnd.first_extra_s) if rounds else 0.0
    first = max(x.time_to_first_batch_s for x in loaders)
    # Under DiLoCo the first round's wait holds the spread of the regions' first batches (``skew``):
    # a region that started early waits it there, so its wall runs from its own first batch, the
    # earliest; counting the latest first batch as well would count the spread twice. (Flat and
    # hierarchical wait the spread in the first step's all-reduce: their wall runs from the latest.)
    start = min(x.time_to_first_batch_s for x in loaders) if rounds else first
    # a rank's wall holds the rounds' waits less the regions' arrival skew (made up in slower steps)
    in_wall = outer.mean_round_wait_s(rnd.seconds - rnd.arrival_s, cfg, step, skew + rnd.first_extra_s) if rounds else 0.0
    wall = start + cfg.steps * step + rounds * in_wall
    # report.json's IO wait share after the first batch is over the wall after it, rounds' waits included
    after = step + rounds * in_wall / cfg.steps
    utilization = min(1.0, cfg.steps * compute / wall) if wall > 0 else 0.0

    pairs: dict[tuple[str, str], float] = {}
    for a, b, n in exchange.pair_bytes:
        pairs[(a, b)] = pairs.get((a, b), 0.0) + n * cfg.steps
    for a, b, n in rnd.pair_bytes:
        pairs[(a, b)] = pairs.get((a, b), 0.0) + n * rounds
    for a, b, n in outer.join_pair_bytes(cfg):  # round 0: the first region's parameters, once
        pairs[(a, b)] = pairs.get((a, b), 0.0) + n
    for r, x in zip(cfg.regions, loaders, strict=True):
        if x.egress_bytes:
            key = (r.data_region or r.name, r.name)
            pairs[key] = pairs.get(key, 0.0) + x.egress_bytes
    usd = cost.egress_usd(pairs, cfg.prices)
    regions = tuple(
        RegionPrediction(
            r.name,
            r.ranks,
            x.time_to_first_batch_s,
            x.io_wait_s_per_step / after if after > 0 else 0.0,
            r.tier,
            x.tier_bytes,
            x.egress_bytes,
        )
        for r, x in zip(cfg.regions, loaders, strict=True)
    )
    return Prediction(
        sync=cfg.sync,
        steps=cfg.steps,
        world_size=cfg.world_size,
        samples=cfg.steps * cfg.batch_size * cfg.accum_steps * cfg.world_size,
        utilization=utilization,
        grad_sync_s_per_step=exchange.seconds,
        cross_region_grad_bytes_per_step=exchange.cross_bytes,
        io_wait_share_after_first_batch=wait / after if after > 0 else 0.0,
        time_to_first_batch_s=first,
        step_s=after,
        compute_s_per_step=compute,
        outer_round_count=rounds,
        outer_round_s=rnd.seconds,
        outer_sync_s_mean=round_wait,
        outer_bytes=rnd.bytes * rounds,
        outer_calibrated=rnd.calibrated,
        outer_phases=rnd.phases,
        cross_region_data_bytes=sum(x.egress_bytes for x in loaders),
        regions=regions,
        pair_bytes=tuple((a, b, n) for (a, b), n in sorted(pairs.items())),
        egress_usd=tuple((a, b, x) for (a, b), x in sorted(usd.items())),
    )


def _r(x: float) -> float:
    return round(float(x), 6)
