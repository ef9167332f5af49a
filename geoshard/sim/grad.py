"""DDP's gradient exchange per optimizer step: gloo's ring all-reduce, flat or hierarchical.

A ring all-reduce of B bytes over n members is 2(n-1) steps (reduce-scatter, then all-gather);
in each, every member sends B/n bytes to its successor and waits for its predecessor's; each
member sends 2(n-1)/n·B, and the ring's slowest hop sets the pace (``ring_allreduce_s``). DDP
all-reduces its buckets one after another (the first bucket holds 1 MB of gradients, the next
25 MB each); accumulation syncs once per optimizer step (no_sync before).

A process group of one rank (a one-rank job, or a one-rank region under DiLoCo) has no DDP and no
hook (trainer/comm.py ``for_sync``): its exchange is 0. Under DiLoCo each region's ranks wait only
for their own region's all-reduce: the step's figure is their mean over the job's ranks.

``flat``: one ring over every rank in rank order (regions in the job's order): R of its hops cross
regions. ``hierarchical``: reduce onto each region's leader, a ring over the leaders (fp16 here
only), a broadcast back; the in-region hops cost B at the region's own rate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from geoshard.sim.config import Constants, LinkSpec, SimConfig
from geoshard.sim.links import delivered_s, one_way, rate, transfer_s

FIRST_BUCKET = 1024 * 1024  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
BUCKET = 25 * 1024 * 1024  # DDP's bucket_cap_mb default
MLP_INPUT, MLP_CLASSES = 256, 10  # geoshard.trainer.model.Net's shape


@dataclass(frozen=True)
class GradStep:
    seconds: float  # one optimizer step's exchange, as every rank waits for it
    cross_bytes: float  # bytes the job's ranks send to another region per step (report.json's count)
    pair_bytes: tuple[tuple[str, str, float], ...]  # (from, to, bytes per step) between regions


def mlp_tensors(hidden: int) -> tuple[int, ...]:
    """The built-in MLP's gradients in DDP's bucketing order (parameters reversed)."""
    h = hidden
    return (MLP_CLASSES, MLP_CLASSES * h, h, h * h, h, MLP_INPUT * h)


def buckets(tensor_bytes: tuple[int, ...]) -> list[int]:
    """DDP's bucket sizes: tensors in order, a bucket closes once it reaches its cap (1 MB, then 25 MB)."""
    out: list[int] = []
    cur = 0
    for b in tensor_bytes:
        cur += b
        if cur >= (FIRST_BUCKET if not out else BUCKET):
            out.append(cur)
            cur = 0
    return [*out, cur] if cur else out


def ring_allreduce_s(
    sizes: list[float], members: int, hops: list[LinkSpec | None], k: Constants, concurrent: int = 1, idle_s: float = math.inf
) -> float:
    """All-reduces of ``sizes`` bytes one after another on one ring of ``members``: each is 2(n-1) steps,
    and each step pays ``ring_step_latencies`` of a hop's one-way latency (2: a round trip, the
    receiver's notice that its buffer is ready, then the chunk) and ``trip_s``; the bytes a hop
    carries, 2(n-1)/n of the total, flow on one connection that warms up across steps and buckets
    (its ramp is paid once per optimizer step). The slowest distinct hop sets the pace:
    T = max over hops of [2(n-1)·ceil(len(sizes)/concurrent)·(c·latency + trip_s) + delivered(2(n-1)/n·sum(sizes))];
    ``concurrent`` all-reduces in flight at once share their round trips, not their bytes. A hop idle
    for ``idle_s`` between steps restarts slow start only past its retransmission timeout
    (rtt + ``rto_min_s``, Linux's tcp_slow_start_after_idle); a warm one moves at its rate at once."""
    if members < 2 or not sizes:
        return 0.0
    trips = 2 * (members - 1) * -(-len(sizes) // max(1, concurrent))
    carried = 2 * (members - 1) * sum(sizes) / members
    return max(trips * (k.ring_step_latencies * one_way(h) + k.trip_s) + _delivered(carried, h, k, idle_s) for h in hops)


def _delivered(nbytes: float, hop: LinkSpec | None, k: Constants, idle_s: float) -> float:
    if hop is None or idle_s <= 2 * one_way(hop) + k.rto_min_s:
        return nbytes / rate(hop, k)
    return delivered_s(nbytes, 2 * one_way(hop), rate(hop, k), k)


def step_exchange(cfg: SimConfig, step: int = 0, idle_s: float = math.inf) -> GradStep:
    """The exchange of one optimizer step (``step`` decides fp16 vs fp32 after ``fp32_after``);
    ``idle_s``: the links' idle time between two steps' exchanges (the step's compute)."""
    largest = max(r.ranks for r in cfg.regions)
    if cfg.params <= 0 or (largest if cfg.sync == "diloco" else cfg.world_size) < 2:
        return GradStep(0.0, 0.0, ())
    fp16 = cfg.grad_compression == "fp16" and (cfg.fp32_after is None or step < cfg.fp32_after)
    tensors = cfg.tensor_params or _even_tensors(cfg.params)
    sizes = buckets(tuple(4 * t for t in tensors))
    if cfg.sync == "flat":
        out = _flat(cfg, sizes, 0.5 if fp16 else 1.0, idle_s)
    elif cfg.sync == "hierarchical":
        out = _hierarchical(cfg, sizes, 0.5 if fp16 else 1.0, idle_s)
    else:
        return _diloco_in_region(cfg, sizes)
    # The comm hook's own time per bucket (its cast, copy and the call into gloo).
    return dataclasses.replace(out, seconds=out.seconds + len(sizes) * cfg.constants.bucket_s)


def _diloco_in_region(cfg: SimConfig, sizes: list[int]) -> GradStep:
    """DiLoCo: DDP inside each region only, a flat ring over the region's ranks plus the hook's
    ``bucket_s`` per bucket; a one-rank region runs neither. The regions do not wait for each other
    between rounds, so the figure is the mean over the job's ranks, as report.json averages it."""
    k = cfg.constants
    total = 0.0
    for r in cfg.regions:
        if r.ranks > 1:
            one = ring_allreduce_s([float(b) for b in sizes], r.ranks, [None], k, k.gloo_threads) + len(sizes) * k.bucket_s
            total += r.ranks * one
    return GradStep(total / cfg.world_size, 0.0, ())


def mean_exchange(cfg: SimConfig, idle_s: float = math.inf) -> GradStep:
    """The exchange averaged over the run: fp16 steps before ``fp32_after``, fp32 after."""
    a = step_exchange(cfg, 0, idle_s)
    if cfg.grad_compression != "fp16" or cfg.fp32_after is None or cfg.fp32_after >= cfg.steps:
        return a
    b = step_exchange(cfg, cfg.steps, idle_s)
    w = cfg.fp32_after / cfg.steps
    pairs = {(s, d): w * n for s, d, n in a.pair_bytes}
    for s, d, n in b.pair_bytes:
        pairs[(s, d)] = pairs.get((s, d), 0.0) + (1 - w) * n
    return GradStep(
        w * a.seconds + (1 - w) * b.seconds,
        w * a.cross_bytes + (1 - w) * b.cross_bytes,
        tuple((s, d, n) for (s, d), n in pairs.items()),
    )


def _even_tensors(params: int) -> tuple[int, ...]:
    whole, rest = divmod(params, 1_000_000)
    return (1_000_000,) * whole + ((rest,) if rest else ())


def _ring_hops(cfg: SimConfig, order: list[tuple[str, int]]) -> tuple[list[LinkSpec | None], list[tuple[str, str]]]:
    """The ring's distinct hops (None: inside a region) and its region-crossing hops, for members
    grouped as (region, count) in ring order."""
    crossing = [(order[i][0], order[(i + 1) % len(order)][0]) for i in range(len(order)) if len(order) > 1]
    hops: list[LinkSpec | None] = [cfg.link(a, b) for a, b in crossing]
    if any(n > 1 for _, n in order):
        hops.append(None)
    return hops, crossing


def _flat(cfg: SimConfig, sizes: list[int], wire: float, idle_s: float) -> GradStep:
    n = cfg.world_size
    hops, crossing = _ring_hops(cfg, [(r.name, r.ranks) for r in cfg.regions])
    # flat's hook is asynchronous: gloo runs its buckets' all-reduces on its worker threads at once
    seconds = ring_allreduce_s([b * wire for b in sizes], n, hops, cfg.constants, cfg.constants.gloo_threads, idle_s)
    per_hop = sum(2 * (n - 1) * b * wire / n for b in sizes)
    return GradStep(seconds, per_hop * len(crossing), tuple((a, b, per_hop) for a, b in crossing))


def _hierarchical(cfg: SimConfig, sizes: list[int], wire: float, idle_s: float) -> GradStep:
    n = len(cfg.regions)
    hops, crossing = _ring_hops(cfg, [(r.name, 1) for r in cfg.regions])
    k = cfg.constants
    cross = ring_allreduce_s([b * wire for b in sizes], n, hops, dataclasses.replace(k, trip_s=k.trip_s + k.hook_trip_s), idle_s=idle_s)
    seconds = cross + _in_region(cfg, sizes).seconds
    per_hop = sum(2 * (n - 1) * b * wire / n for b in sizes)
    return GradStep(seconds, per_hop * len(crossing), tuple((a, b, per_hop) for a, b in crossing))


def _in_region(cfg: SimConfig, sizes: list[int]) -> GradStep:
    """Reduce to the leader and broadcast back inside the largest region (gloo: a tree, about log2(r) hops of B each)."""
    largest = max(r.ranks for r in cfg.regions)
    if largest < 2:
        return GradStep(0.0, 0.0, ())
    hops = (largest - 1).bit_length()
    one = sum(transfer_s(b, None, cfg.constants) for b in sizes)
    return GradStep(2 * hops * one, 0.0, ())
