"""DiLoCo across regions: each region trains alone for H inner steps, then the regions average
their pseudo-gradients (outer parameters minus current parameters) and apply them with an outer
Nesterov SGD step (arXiv 2311.08105; lr 0.7, momentum 0.9 by default).

Why not torchft, and why a store (docs/diloco.md has the longer story): a region is several ranks
doing DDP in their own process group, and a region that is lost must not break the others'
groups, so the regions never share a process group. Their leaders meet in a key-value store
that tolerates missing members: a ``torch.distributed.TCPStore`` hosted by the launcher (which
outlives every region), or anything with the same ``set``/``get``/``add``/``check`` methods.

One outer round ``r``, on each region's leader (in-region rank 0):
  1. publish the compressed pseudo-gradient under ``r`` and the region;
  2. wait, at most ``round_timeout_s``, for the regions expected in ``r`` (the members of round
     ``r-1`` and any region that announced a rejoin);
  3. the first leader done waiting closes the round: it writes the regions whose pseudo-gradient
     is there (an atomic ``add`` picks one closer, so every leader averages over the same set);
  4. each leader averages over those regions in job order (the same sum everywhere), applies the
     outer step, and the closer publishes the new outer state (parameters, momentum) for the
     round, so a region that rejoins starts from it (live recovery);
  5. the leader broadcasts the new parameters in its region.
A region whose pseudo-gradient missed the close (it was late or is rejoining) takes the round's
published state instead of its own result and goes on from there.

Nothing read from the store is trusted: every value is signed with the job's secret and checked
against the model before use (docs/diloco.md, "Authentication and checks").

The modules, bottom up: ``auth`` (the job's secret, HMAC signatures, refusals counted), ``kv``
(the store, signed values in parts), ``codec`` (the pseudo-gradient's bytes: fp16, bf16, fp32, int8,
fp8, and error feedback), ``settings`` (``OuterSync``, the pseudo-gradient's compression),
``checks`` (every value read against the model's bounds), ``record`` (``RoundRecord``: the round,
and the rounds file's one writer and reader), ``roster`` (who a round waits for, who it averaged), ``optimizer`` (the
outer parameters, their SGD, the published state), ``exchange`` (one round on a leader, and the
thread that runs it behind training), ``rank`` (``DiLoCo``: one per rank), ``loop`` (DiLoCo in
the trainer's loop) and ``report`` (the report's rounds).

The peer-to-peer transport (``OuterSync(transport="p2p")``, ``--outer-transport p2p``; docs/diloco.md):
every rank keeps its shards of the outer state (``shards``) and all-reduces them over gloo groups
made on the store (``groups``) with the other regions' owners, in ring order (``ring``), several
streams at once (``sharded``; ``sharded_allreduce`` for benches), checks each sum with a linear MAC
(``mac``); the leaders agree on members and attempts through small keys (``membership``); ``p2p``
is one round on a rank. The store carries no pseudo-gradient and no state.

Names are imported on first use, so the report (``diloco.report``) reads rounds files without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geoshard.trainer.diloco.kv import PART_BYTES, OuterSyncError, Store, connect_store, host_store
    from geoshard.trainer.diloco.rank import DiLoCo
    from geoshard.trainer.diloco.record import JoinRecord, RoundRecord
    from geoshard.trainer.diloco.settings import COMPRESSIONS, OuterSync, decode, encode
    from geoshard.trainer.diloco.sharded import sharded_allreduce

_WHERE = {
    "PART_BYTES": "kv",
    "OuterSyncError": "kv",
    "Store": "kv",
    "connect_store": "kv",
    "host_store": "kv",
    "DiLoCo": "rank",
    "JoinRecord": "record",
    "RoundRecord": "record",
    "COMPRESSIONS": "settings",
    "OuterSync": "settings",
    "decode": "settings",
    "encode": "settings",
    "sharded_allreduce": "sharded",
}
__all__ = [
    "COMPRESSIONS",
    "PART_BYTES",
    "DiLoCo",
    "JoinRecord",
    "OuterSync",
    "OuterSyncError",
    "RoundRecord",
    "Store",
    "connect_store",
    "decode",
    "encode",
    "host_store",
    "sharded_allreduce",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
