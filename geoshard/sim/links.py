"""One TCP transfer over a WAN link: one-way latency, the slow-start ramp, then the link's rate.

A flow starts with ``init_cwnd`` segments and doubles its window every round trip until the window
holds the link's bandwidth-delay product; from then on it moves at the link's rate (its cap, or
the rehearsal forwarder's ceiling, whichever is lower). Linux restarts slow start on a connection
idle for longer than its retransmission timeout (``tcp_slow_start_after_idle``), which a
connection used once per training step usually is, so every step's exchange starts cold; the
chunks of one exchange follow each other on a warm one (``warm_bytes``).
"""

from __future__ import annotations

import math

from geoshard.sim.config import Constants, LinkSpec

INF = float("inf")


def rate(link: LinkSpec | None, k: Constants) -> float:
    """Bytes per second one flow can reach: the cap, the forwarder's ceiling, or a region's own network."""
    if link is None:
        return k.local_mb_s * 1e6
    r = link.bandwidth_mbit * 1e6 / 8 if link.bandwidth_mbit else INF
    if k.ceiling_mb_s is not None:
        r = min(r, k.ceiling_mb_s * 1e6)
    return r if r < INF else 10e9 / 8  # no cap and no forwarder: a 10 Gbit/s path


def one_way(link: LinkSpec | None) -> float:
    return link.latency_ms / 1000 if link is not None else 0.0


def delivered_s(nbytes: float, rtt: float, bps: float, k: Constants, fresh: bool = False) -> float:
    """Seconds from a fresh flow's first byte to its ``nbytes``-th, latency excluded.

    Round i of slow start sends W0·2^i bytes (W0 = init_cwnd·mss) until the window reaches the
    bandwidth-delay product bps·rtt after K = ceil(log2(bdp/W0)) rounds, R = W0(2^K - 1) bytes.
    Up to R: the rounds it takes, the last one paced at the rate; past R: K round trips + the rest at the rate.
    ``fresh``: a new connection, whose receiver's window (``init_rwnd``) also starts small.
    """
    if nbytes <= 0:
        return 0.0
    w0 = min(k.init_cwnd * k.mss, k.init_rwnd) if fresh else k.init_cwnd * k.mss
    bdp = bps * rtt
    ramp_rounds = max(0, math.ceil(math.log2(bdp / w0))) if bdp > w0 else 0
    ramp_bytes = w0 * (2**ramp_rounds - 1)
    if nbytes > ramp_bytes:
        return ramp_rounds * rtt + (nbytes - ramp_bytes) / bps
    rounds = math.ceil(math.log2(nbytes / w0 + 1))  # 1..ramp_rounds
    before = w0 * (2 ** (rounds - 1) - 1)
    return (rounds - 1) * rtt + (nbytes - before) / bps


def transfer_s(nbytes: float, link: LinkSpec | None, k: Constants, warm_bytes: float = 0.0, fresh: bool = False) -> float:
    """Seconds to move ``nbytes`` over ``link`` on a flow that already moved ``warm_bytes`` without
    pausing: one-way latency + the part of the ramp these bytes take + ``trip_s``. ``fresh``: on a
    new connection (``delivered_s``)."""
    if link is None:
        return nbytes / rate(None, k) + k.trip_s
    bps, rtt = rate(link, k), 2 * one_way(link)
    return one_way(link) + delivered_s(warm_bytes + nbytes, rtt, bps, k, fresh) - delivered_s(warm_bytes, rtt, bps, k, fresh) + k.trip_s


def new_connection_s(nbytes: float, link: LinkSpec | None, k: Constants) -> float:
    """A request of ``nbytes`` on a connection opened for it: the handshake's round trip, the
    request out, then the bytes back on a window both ends start small."""
    return 3 * one_way(link) + transfer_s(nbytes, link, k, fresh=True)


def round_trip_s(link: LinkSpec | None, k: Constants) -> float:
    """One small request and its answer (a store get, an ack)."""
    return 2 * one_way(link) + k.trip_s
