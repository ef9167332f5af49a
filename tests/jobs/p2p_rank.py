"""Run by tests/test_diloco_p2p.py: one rank of one region calling the sharded exchange directly
(``sharded_allreduce``) over a TCPStore that the test hosts on 127.0.0.1.

argv: MODE REGION RANK STORE_PORT MEMBERS COMPRESSION OUT
  sum   each region contributes randn(NUMEL) seeded by its index in MEMBERS; writes the result's
        largest distance from the plain sum, the bytes sent and the store's bytes as one JSON line
        in OUT/REGION-RANK.json
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from geoshard.trainer.diloco.groups import CountingStore
from geoshard.trainer.diloco.sharded import sharded_allreduce

NUMEL = 100_003  # not a multiple of any shard count


def contribution(i: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))


def main() -> None:
    mode, region, rank, port, spec, compression, out = sys.argv[1:8]
    members = [(g, int(n)) for g, n in (x.split(":") for x in spec.split(","))]
    names = [g for g, _ in members]
    store = CountingStore(dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=datetime.timedelta(seconds=60)))
    assert mode == "sum"
    mine = contribution(names.index(region))
    got, sent = sharded_allreduce(store, members, region, int(rank), mine, compression=compression, streams=3, tag="test/sum")
    parts = [contribution(i) for i in range(len(members))]
    ref = torch.stack(parts).sum(0)
    bound = torch.stack(parts).abs().sum(0)  # the sum's rounding is bounded by (m-1) u sum |x|
    doc = {
        "max_abs": float((got - ref).abs().max()),
        "max_rel_to_bound": float(((got - ref).abs() / bound).max()),
        "sent": sent,
        "store_bytes": store.carried,
        "numel": got.numel(),
    }
    Path(out, f"{region}-{rank}.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
