"""The rejoin hand-over: a region that comes back takes the outer state (fp32 parameters and
momentum) peer to peer from a live region, in the round it rejoins (``P2PExchange._sum`` calls it
after either sum: fp16 / bf16 / fp32, or int8 / fp8)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed import BroadcastOptions

from geoshard.trainer.diloco import state_auth
from geoshard.trainer.diloco.kv import OuterSyncError
from geoshard.trainer.diloco.sharded import Membership as Ring
from geoshard.trainer.diloco.sharded import ShardGroups, region_max

if TYPE_CHECKING:
    from geoshard.trainer.diloco.membership import Decision
    from geoshard.trainer.diloco.p2p import P2PExchange

OTHER_REFUSED = "another rank of the region refused its shard"


def hand_over(ex: P2PExchange, groups: ShardGroups, ring: Ring, d: Decision, key: str) -> int:
    """Regions that rejoined get the outer state (fp32 parameters and momentum) from the first
    member in ring order that did not, peer to peer: each owner broadcasts its shards, in the
    streams' chunks, on the shard's groups, before the step (which every member then takes
    alike), with their signed digests under ``key`` (``state_auth``). The bytes this rank sent."""
    source = next(g for g, _ in ring.members if g not in d.fresh)
    root = ring.index(source)
    mom = ex.opt.momentum()
    at = ex.layout.offsets()
    state = {
        s: (p.clone(), torch.zeros_like(p) if mom is None else mom[at[s] : at[s] + p.numel()].clone())
        for s, p in ex.layout.by_shard(ex.opt.params).items()
    }

    def pieces(s: int) -> list[torch.Tensor]:
        return [t for a, b in groups.pieces(s) for t in (state[s][0][a:b], state[s][1][a:b])]

    if ex.region == source:
        for s in state:
            state_auth.publish(ex.kv, f"{key}/{s}", pieces(s))
    works, sent = [], 0
    for s, (params, momentum) in state.items():
        for c, (a, b) in enumerate(groups.pieces(s)):
            opts = BroadcastOptions()
            opts.rootRank = root
            for t in (params[a:b], momentum[a:b]):
                works.append(groups.group(s, c).broadcast([t], opts))
                sent += (len(ring.members) - 1) * 4 * (b - a) if ex.region == source else 0
    for w in works:
        w.wait()
    if ex.region in d.fresh:
        why = state_auth.check_all(ex.kv, [(f"{key}/{s}", pieces(s)) for s in state], ex.sync.round_timeout_s)
        if region_max(ex.region_group, int(bool(why))):
            why = why or OTHER_REFUSED
            raise OuterSyncError(f"DiLoCo: region {ex.region} refused the outer state from {source} ({why}); start it again")
        params = torch.cat([state[s][0] for s in ex.layout.mine])
        momentum = torch.cat([state[s][1] for s in ex.layout.mine])
        ex.opt.reset(params, momentum if ex.sync.outer_momentum > 0 else None)
    return sent
