"""A DiLoCo outer round: the regions' leaders exchange pseudo-gradients every H inner steps.

``store_round`` is today's transport (trainer/diloco/, docs/diloco.md): a TCPStore beside the
job's first region. Each leader publishes its pseudo-gradient P (params x 2 bytes in fp16/bf16, 4
in fp32) to the store (P over its link to the store), waits for the round to close (about
``outer_trips_before`` round trips: roster, close, members), then reads the other m-1 members'
in one multi_get ((m-1)·P back over the same link) and the latest state (``outer_trips_after``
round trips in all). The round closes when the slowest publish has landed, so
round = max_r(publish_r + trips_before·rtt_r) + max_r(trips_after·rtt_r + read_r) + B·store_byte_s.
Bytes through the star: B = m·P published + m(m-1)·P read, all of them through the store's one
process (``store_byte_s``: its own work per byte, fitted). P is params x the compression's bytes a
value (``OUTER_BYTES``: 2 for fp16/bf16, 4 for none, about 1 for int8/fp8).

``p2p_round`` is the ring transport another engineer is building (``--outer-transport p2p``):
a ring all-reduce among the m leaders, sharded over ``streams`` connections per pair:
2(m-1)/m·P/(bandwidth·streams_efficiency) + 2(m-1) trips. Not yet calibrated.

With ``outer_overlap`` K the exchange runs behind K inner steps: the job waits
max(0, round - K·step) per round, where K is at most the steps left after the round's start (a
round at the last step is waited in full); report.json's ``outer.sync_s_mean`` is their mean.
"""

from __future__ import annotations

from dataclasses import dataclass

from geoshard.sim.config import OUTER_BYTES, SimConfig
from geoshard.sim.links import one_way, rate, round_trip_s, transfer_s

P2P_STREAM_EFFICIENCY = 0.9  # assumed share of the link a sharded ring keeps busy: not calibrated


@dataclass(frozen=True)
class OuterRound:
    seconds: float  # one round's exchange, start to end (before any overlap)
    bytes: float  # report.json's outer round bytes: published + read, over the leaders
    pair_bytes: tuple[tuple[str, str, float], ...]  # (from, to, bytes per round) between regions
    calibrated: bool = True


def pseudo_gradient_bytes(cfg: SimConfig) -> float:
    return cfg.params * OUTER_BYTES[cfg.outer_compression]


def store_round(cfg: SimConfig) -> OuterRound:
    k = cfg.constants
    p = pseudo_gradient_bytes(cfg)
    m = len(cfg.regions)
    host = cfg.regions[0].name  # geoshard train hosts the store beside the first region
    if m < 2 or p <= 0:
        return OuterRound(0.0, 0.0, ())
    links = {r.name: cfg.link(r.name, host) for r in cfg.regions}
    trip = {r: round_trip_s(links[r], k) + k.store_request_s for r in links}
    before = max(transfer_s(p, links[r], k) + k.outer_trips_before * trip[r] for r in links)
    after = max(k.outer_trips_after * trip[r] + transfer_s((m - 1) * p, links[r], k) for r in links)
    pairs = []
    for r in links:
        if r != host:
            pairs += [(r, host, p), (host, r, (m - 1) * p)]
    total = m * p + m * (m - 1) * p  # every byte of the round passes the store's one process
    return OuterRound(before + after + total * k.store_byte_s, total, tuple(pairs))


def p2p_round(cfg: SimConfig) -> OuterRound:
    """The ring transport, from the ring bound; flagged as not calibrated against runs."""
    k = cfg.constants
    p = pseudo_gradient_bytes(cfg)
    m = len(cfg.regions)
    if m < 2 or p <= 0:
        return OuterRound(0.0, 0.0, (), calibrated=False)
    names = [r.name for r in cfg.regions]
    hops = [cfg.link(names[i], names[(i + 1) % m]) for i in range(m)]
    carried = 2 * (m - 1) / m * p
    seconds = max(carried / (rate(h, k) * P2P_STREAM_EFFICIENCY) + 2 * (m - 1) * (one_way(h) + k.trip_s) for h in hops)
    pairs = tuple((names[i], names[(i + 1) % m], carried) for i in range(m))
    return OuterRound(seconds, m * carried, pairs, calibrated=False)


def join_pair_bytes(cfg: SimConfig) -> tuple[tuple[str, str, float], ...]:
    """A fresh job's round 0 (trainer/diloco/rank.py ``join``): the first region publishes its
    parameters to the store beside it and every other region's leader reads them once, in fp32
    (torch's serialized state: 4 bytes a parameter; its few hundred bytes of framing left out)."""
    if cfg.sync != "diloco" or len(cfg.regions) < 2 or cfg.params <= 0:
        return ()
    host = cfg.regions[0].name
    return tuple((host, r.name, 4.0 * cfg.params) for r in cfg.regions[1:])


def exchange_round(cfg: SimConfig) -> OuterRound:
    return p2p_round(cfg) if cfg.outer_transport == "p2p" else store_round(cfg)


def round_wait_s(round_s: float, overlap_steps: int, step_s: float) -> float:
    """What the job waits per round once the exchange runs behind ``overlap_steps`` inner steps."""
    return max(0.0, round_s - overlap_steps * step_s)


def mean_round_wait_s(round_s: float, cfg: SimConfig, step_s: float, skew_s: float = 0.0) -> float:
    """The wait per round over the run. A round starting at step s hides behind at most the
    steps left after it: the trainer takes a round still in flight after the last step
    (trainer/diloco/rank.py, ``finish``), so with steps a multiple of H the last round is waited
    in full even with ``--outer-overlap``. The first round also waits for the regions' start-up
    skew ``skew_s`` (the last region to start reaches it that much later than the first)."""
    h, k = cfg.outer_steps, cfg.outer_overlap
    n = cfg.steps // h if h > 0 else 0  # rounds start at steps h, 2h, ... <= steps
    if n == 0:
        return 0.0
    # O(1) in the rounds (a search predicts runs of millions of steps): every round hides behind k
    # steps but the first (the skew) and those starting fewer than k steps before the end
    tail = (cfg.steps - k) // h if cfg.steps >= k else 0  # the first round starting fewer than k steps before the end
    special = sorted({0, *range(tail, n)})
    waits = [round_wait_s(round_s + (skew_s if i == 0 else 0.0), min(k, cfg.steps - (i + 1) * h), step_s) for i in special]
    return (sum(waits) + (n - len(special)) * round_wait_s(round_s, k, step_s)) / n


def startup_skew_s(first_batches: list[float], cfg: SimConfig) -> float:
    """How much later the last region reaches its first round than the first: its first batch's
    lead (remote data, more ranks) plus ``startup_skew_s``, the launch's own stagger."""
    return (max(first_batches) - min(first_batches) if first_batches else 0.0) + cfg.constants.startup_skew_s
