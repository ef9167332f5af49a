"""Round 0 over the peer-to-peer transport: a fresh or wholly resumed job's regions all start from
the job's first region's parameters (and its outer momentum, where its checkpoint holds one), sent
peer to peer by that region's owners on the shards' groups, checked against signed digests."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.distributed import BroadcastOptions

from geoshard.trainer.diloco import state_auth
from geoshard.trainer.diloco.codec import non_finite
from geoshard.trainer.diloco.handover import OTHER_REFUSED
from geoshard.trainer.diloco.kv import OuterSyncError
from geoshard.trainer.diloco.membership import last_round
from geoshard.trainer.diloco.ring import restrict
from geoshard.trainer.diloco.sharded import Membership as Ring
from geoshard.trainer.diloco.sharded import ShardGroups, gather_in_region, make_groups, region_max

if TYPE_CHECKING:
    from geoshard.trainer.diloco.p2p import P2PExchange

log = logging.getLogger(__name__)


def first_round(ex: P2PExchange, source: str, current: torch.Tensor, join_timeout_s: float) -> tuple[torch.Tensor, int, int]:
    """Round 0 (a fresh or wholly resumed job): every region starts from ``source``'s parameters
    (the job's first region: its own, or its checkpoint's). ``source``'s owners broadcast their
    fp32 shards on the shards' groups (round 1 reuses them while its members are the same), the
    other member regions' owners take them, and each region gathers them: the store carries the
    membership and the groups' rendezvous only. The full parameters, the bytes this rank
    received across regions, and the round the region starts from (0). A region that came
    after round 0 closed keeps ``current``, starts from the newest closed round (as a region
    that rejoins does) and takes the outer state in its first round (``fresh``)."""
    if ex.region == source and ex.layout.k == 0:  # before its ready key: whoever sees it a member finds it
        ex.kv.set(ex.kv.key("r", 0, 0, "momentum"), "1" if ex.opt.momentum() is not None else "0")
    d = ex.decide(0, 0, (), lambda: ex.membership.decide_first(source, join_timeout_s))
    if source not in d.members:
        raise OuterSyncError(
            f"DiLoCo: outer round 0 closed without {source}, whose parameters every region starts from "
            f"(it did not come within {join_timeout_s:g} s); start the job again"
        )
    if not d.member:
        log.warning("DiLoCo: region %s came after outer round 0 closed; it takes the outer state in its first round", ex.region)
        ex.fresh = True
        last = last_round(ex.kv) if ex.layout.k == 0 else 0  # rounds may have closed since round 0
        if ex.layout.k == 0:
            ex.membership.roster.announce(ex.region, last + 1)
        ex.opt.reset(ex.own(current), None)
        return current, 0, region_max(ex.region_group, last)
    own = ex.layout.by_shard(ex.own(current))
    mom = _momentum_of(ex, source)
    received = 0
    if len(d.members) > 1:
        ring = Ring(tuple((g, ex.job[g]) for g in restrict(ex.ring, d.members)), f"m{d.name}")
        timeout = ex.sync.round_timeout_s
        args = (ex.region, ex.sync.streams, ex.bind, timeout, ex.cache)
        groups = ShardGroups(ex.store, ex.kv.key("pg"), ex.layout, ring, *args)
        try:
            make_groups(groups, ex.layout.mine)

            def pieces(s: int) -> list[torch.Tensor]:  # the parameters' chunks, then the momentum's
                return [t[a:b] for t in (own[s], *([mom[s]] if mom else [])) for a, b in groups.pieces(s)]

            if ex.region == source:
                for s in ex.layout.mine:
                    state_auth.publish(ex.kv, ex.kv.key("r", 0, 0, "state", s), pieces(s))
                    if ex.corrupt is not None:  # tests: a change made on the wire, after the digests
                        ex.corrupt(0, s, own[s])
            works = []
            for s in ex.layout.mine:
                for i, t in enumerate(pieces(s)):
                    opts = BroadcastOptions()
                    opts.rootRank = ring.index(source)
                    works.append(groups.group(s, i % len(groups.pieces(s))).broadcast([t], opts))
            for w in works:
                w.wait()
        except RuntimeError as e:  # a peer lost while round 0 travelled: the job starts again
            if ex.layout.k == 0:
                ex.membership.mark_failed(0, 0)
            raise OuterSyncError(f"DiLoCo: outer round 0 from {source} failed: {str(e).strip()[:160]}") from None
        received = 0 if ex.region == source else 4 * ex.layout.own_numel * (2 if mom else 1)
        if ex.region != source:
            sent_to_us = [(ex.kv.key("r", 0, 0, "state", s), pieces(s)) for s in ex.layout.mine]
            why = state_auth.check_all(ex.kv, sent_to_us, timeout)
            if region_max(ex.region_group, int(bool(why))):
                raise OuterSyncError(f"DiLoCo: outer round 0 from {source}: refused ({why or OTHER_REFUSED})")
    bad = sum(non_finite(t) for t in (*own.values(), *mom.values()))
    if region_max(ex.region_group, int(bad > 0)):
        raise OuterSyncError(f"DiLoCo: outer round 0 from {source}: parameters that are NaN or infinite arrived; refused")
    momentum = torch.cat([mom[s] for s in ex.layout.mine]) if mom else None
    ex.opt.reset(torch.cat([own[s] for s in ex.layout.mine]), momentum)
    full, _ = gather_in_region(ex.region_group, ex.layout, ex.layout.by_shard(ex.opt.params))
    return full, received, 0


def _momentum_of(ex: P2PExchange, source: str) -> dict[int, torch.Tensor]:
    """Round 0: the source region's outer momentum shards, which it sends with its parameters (a
    whole job resumed from checkpoints that hold it: resume.py), or {} (a fresh job: zero). The
    source's leader says which under a signed key before round 0 closes; every rank of every
    member region learns it (this rank's buffers to send or to receive into)."""
    key = ex.kv.key("r", 0, 0, "momentum")
    held = ex.opt.momentum()
    has = 0
    if ex.layout.k == 0:
        if ex.region == source:
            has = int(held is not None)
        elif not ex.kv.wait_all([key], ex.sync.round_timeout_s) or (value := ex.kv.open_many([key])[0]) not in (b"0", b"1"):
            raise OuterSyncError(f"DiLoCo: outer round 0 from {source}: refused ({key} is missing, unsigned or not 0 or 1)")
        else:
            has = int(value == b"1")
    if not region_max(ex.region_group, has):
        return {}
    if ex.region == source:
        assert held is not None
        return ex.layout.by_shard(held)
    return {s: torch.zeros(b - a) for s in ex.layout.mine for a, b in [ex.layout.span(s)]}
