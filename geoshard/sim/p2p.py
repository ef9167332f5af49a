"""A DiLoCo outer round over the peer-to-peer transport (trainer/diloco/p2p.py), phase by phase.

The trainer times each round in the phases its records carry (``rounds-<region>.jsonl``,
``phases``); the model has one term per phase, so a prediction and a run compare phase by phase:

- ``members``: the region leaders decide the round through the store beside the first region;
  once the last region is ready, the farthest leader still sees its ready key, reads it, asks to
  close, waits for the members and reads them: ``p2p_member_trips`` round trips to the store's
  region (membership.py); then each leader broadcasts the decision in its region.
- ``groups``: the shards' gloo groups, made at once, in the first round only (round 0's or round
  1's; reused while the members stay): ``p2p_groups_s``, fitted.
- ``prepare``, ``mac_publish``, ``mac_check``, ``step``: one pass each over the values a rank owns
  (the pseudo-gradient and its cast, the MAC projections published, the sum's projections checked,
  the outer Nesterov step), ``p2p_*_value_s`` seconds a value, fitted. ``mac_publish`` runs
  while the chunks travel: the round takes the longer of the two.
- ``transfer``: every shard's ring all-reduce among the member regions' owners, all at once:
  S shards (the most ranks a region has) of ceil(streams/S) chunks each, so about ``streams``
  TCP flows per region pair share a hop. Each directed hop carries 2(m-1)/m of the pseudo-gradient
  P; the slowest hop paces the ring: 2(m-1) ring steps of ``ring_step_latencies`` one-way
  latencies of the longest hop, plus each flow's share delivered at the hop's rate over the flows
  (each flow ramps on its own: links.delivered_s at its share of the rate).
- ``gather``: in a region of n > 1 ranks, every rank receives the fp32 shards it does not own
  from their owners: ``p2p_gather_value_s`` a value of the whole vector, fitted (0 in a one-rank region).
- ``other``: ``p2p_fixed_s`` a round, fitted as what the slowest region waits beyond the terms
  above: the regions' arrival skew (the first region to arrive waits in ``members`` for the last),
  the region's agreement, the rest.
- int8/fp8 (``--outer-compression``): reduce-scatter then all-gather in the codec's bytes (1 byte a
  value and a 4-byte scale per 1,024 values: the same 2(m-1)/m on every directed link), an exact
  HMAC of every piece that arrives (``p2p_hmac_byte_s`` a byte) and a decode, sum and re-encode
  pass over the (m-1)/m of its values a rank reduces (``p2p_codec_value_s``). Not calibrated: no
  int8/fp8 p2p run fed these two constants.

A rank's passes run over the values it owns: numel / n in a region of n ranks; the round ends on
the slowest region (a one-rank region owns every value). The bytes between regions: gloo's ring
sends each region's share to the previous region in ring order (the order measured by the
exchange bench: us-east-1 -> ap-southeast-1 -> eu-west-1 -> us-east-1).
"""

from __future__ import annotations

from geoshard.sim.config import OUTER_BYTES, SUMMABLE, SimConfig
from geoshard.sim.links import delivered_s, one_way, rate, round_trip_s
from geoshard.sim.outer import OuterRound, pseudo_gradient_bytes

PHASES = ("members", "groups", "prepare", "mac_publish", "transfer", "mac_check", "step", "gather", "other")


def ring_seconds(cfg: SimConfig, nbytes: float) -> float:
    """The sharded ring all-reduce of ``nbytes`` among the regions' owners, on the wire."""
    k = cfg.constants
    names = [r.name for r in cfg.regions]
    m = len(names)
    hops = [cfg.link(names[i], names[(i + 1) % m]) for i in range(m)]
    shards = max(r.ranks for r in cfg.regions)
    flows = shards * max(1, -(-cfg.outer_streams // shards))  # trainer/diloco/sharded.py per_shard
    carried = 2 * (m - 1) / m * nbytes
    latency = 2 * (m - 1) * (k.ring_step_latencies * max(one_way(h) for h in hops) + k.trip_s)
    wire = 0.0
    for h in hops:
        bps, rtt = rate(h, k), 2 * one_way(h)
        wire = max(wire, one_way(h) + delivered_s(carried / flows, rtt, bps / flows, k))
    return latency + wire


def p2p_round(cfg: SimConfig) -> OuterRound:
    """One round's seconds (the slowest region's), phase by phase, and its bytes between regions."""
    k = cfg.constants
    p = pseudo_gradient_bytes(cfg)
    m = len(cfg.regions)
    if m < 2 or p <= 0:
        return OuterRound(0.0, 0.0, ())
    names = [r.name for r in cfg.regions]
    store = names[0]  # geoshard train hosts the store beside the first region
    trip = max(round_trip_s(cfg.link(r, store), k) for r in names)
    owned = cfg.params / min(r.ranks for r in cfg.regions)  # the values the busiest rank owns
    gather = cfg.params * k.p2p_gather_value_s if max(r.ranks for r in cfg.regions) > 1 else 0.0
    wire = ring_seconds(cfg, p)
    coded = 0.0
    if cfg.outer_compression not in SUMMABLE:  # int8/fp8: check every piece, decode, sum, re-encode
        received = 2 * (m - 1) / m * owned * OUTER_BYTES[cfg.outer_compression]
        coded = received * k.p2p_hmac_byte_s + (m - 1) / m * owned * k.p2p_codec_value_s
    publish = owned * k.p2p_mac_value_s
    phases = (
        ("members", k.p2p_member_trips * trip),
        ("prepare", owned * k.p2p_prepare_value_s),
        ("mac_publish", publish),
        ("transfer", max(0.0, wire - publish) + coded),  # the chunks travel while the projections are published
        ("mac_check", owned * k.p2p_check_value_s),
        ("step", owned * k.p2p_step_value_s),
        ("gather", gather),
        ("other", k.p2p_fixed_s),
    )
    carried = 2 * (m - 1) / m * p
    pairs = tuple((names[i], names[i - 1], carried) for i in range(m))  # gloo's ring sends to the previous rank
    calibrated = cfg.outer_compression in SUMMABLE  # int8/fp8's codec and HMAC constants: no run yet
    return OuterRound(sum(s for _, s in phases), m * carried, pairs, calibrated, k.p2p_groups_s, min(k.p2p_fixed_s, phases[-1][1]), phases)
