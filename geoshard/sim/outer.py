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

``p2p.p2p_round`` is the peer-to-peer transport (``--outer-transport p2p``, geoshard train's
default), phase by phase (geoshard/sim/p2p.py).

With ``outer_overlap`` K the exchange runs behind K inner steps: the job waits
max(0, round - K·step) per round, where K is at most the steps left after the round's start (a
round at the last step is waited in full); report.json's ``outer.sync_s_mean`` is their mean.
"""

from __future__ import annotations

from dataclasses import dataclass

from geoshard.sim.config import OUTER_BYTES, SimConfig
from geoshard.sim.links import round_trip_s, transfer_s


@dataclass(frozen=True)
class OuterRound:
    seconds: float  # one round's exchange, start to end (before any overlap)
    bytes: float  # report.json's outer round bytes: published + read, over the leaders
    pair_bytes: tuple[tuple[str, str, float], ...]  # (from, to, bytes per round) between regions
    calibrated: bool = True
    first_extra_s: float = 0.0  # the first round's own extra (p2p: its gloo groups made)
    # Of ``seconds``, what the first region to arrive waits for the last (p2p): in the slowest
    # region's wait (report.json's sync_s), not in a rank's wall, where the region that arrived
    # last made it up in slower steps.
    arrival_s: float = 0.0
    phases: tuple[tuple[str, float], ...] = ()  # (phase, seconds) as the trainer's p2p round records name them


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


def join_pair_bytes(cfg: SimConfig) -> tuple[tuple[str, str, float], ...]:
    """A fresh job's round 0 (trainer/diloco/rank.py ``join``): every other region receives the
    first region's parameters once, in fp32 (4 bytes a parameter). On the store transport the
    first region publishes them to the store beside it and the leaders read them (torch's
    serialized state; its few hundred bytes of framing left out); on p2p the first region's
    owners broadcast their fp32 shards to the other regions' owners (gloo's broadcast: the root
    sends to each), the store carrying membership only: the same bytes per pair."""
    if cfg.sync != "diloco" or len(cfg.regions) < 2 or cfg.params <= 0:
        return ()
    host = cfg.regions[0].name
    return tuple((host, r.name, 4.0 * cfg.params) for r in cfg.regions[1:])


def exchange_round(cfg: SimConfig) -> OuterRound:
    if cfg.outer_transport == "p2p":
        from geoshard.sim.p2p import p2p_round  # p2p builds on this module's OuterRound

        return p2p_round(cfg)
    return store_round(cfg)


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
    lead (remote data, more ranks) plus ``startup_skew_s``, the launch's own stagger. On p2p,
    round 0 is a collective before the loop (every region waits for the others in ``join``), so
    the stagger is not carried into the loop: ``p2p_startup_skew_s`` (fitted) instead."""
    k = cfg.constants
    own = k.p2p_startup_skew_s if cfg.outer_transport == "p2p" else k.startup_skew_s
    return (max(first_batches) - min(first_batches) if first_batches else 0.0) + own
