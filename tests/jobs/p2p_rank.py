"""Run by tests/test_diloco_p2p.py: one rank of one region calling the sharded exchange directly
(``sharded_allreduce``) over a TCPStore that the test hosts on 127.0.0.1.

argv: MODE REGION RANK STORE_PORT MEMBERS COMPRESSION OUT [REGION_PORT [AGAIN]]
  sum    each region contributes randn(NUMEL) seeded by its index in MEMBERS; writes the result's
         largest distance from the plain sum, the bytes sent and the store's bytes as one JSON line
         in OUT/REGION-RANK.json
  mac    DiLoCo (transport p2p, H=2) for 3 rounds; eu-west-1's rank 0 changes its contribution to
         round 2 after publishing its projections (as a tamperer on the wire would)
  kill   DiLoCo for 4 rounds; ap-southeast-1 writes the time and SIGKILLs itself in round 2, after
         its groups are made, before the all-reduce
  stop   like kill, but it SIGSTOPs itself (a hung region: its sockets stay open); the test kills it
  rejoin like kill, with a model of 330k parameters (its fp32 outer state, 2.6 MB, is more than the
         store may carry), 10 rounds paced by 0.5 s a step; started again with AGAIN=again, the
         region rejoins and takes part until the others finish
  first  DiLoCo for 2 rounds from a fresh job, every rank's model seeded apart (region, rank), with
         330k parameters: round 0 (the first region's parameters) goes peer to peer; each rank writes
         its digest before and after join, and its join's store bytes, to OUT/REGION-RANK.join.json
  late   like first, 8 rounds paced by 0.5 s a step, the join's wait 4 s, the others' first step
         6 s after join; ap-southeast-1 starts 8 s late (after round 0 closed, before round 1
         did): it keeps its own parameters and takes the outer state in its first round
  forge0 like first, but us-east-1's rank changes its round-0 shards after publishing their signed
         digests (as a tamperer on the wire would): a rank that refuses round 0 writes its one line
         to OUT/REGION-RANK.refused and exits 3
  Each DiLoCo rank appends its round records (with the time) to OUT/REGION-RANK.jsonl. A region of
  several ranks is its own gloo world on 127.0.0.1:REGION_PORT.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from geoshard.trainer.diloco import DiLoCo, OuterSync
from geoshard.trainer.diloco.auth import read_secret
from geoshard.trainer.diloco.groups import CountingStore
from geoshard.trainer.diloco.kv import OuterSyncError
from geoshard.trainer.diloco.sharded import sharded_allreduce

NUMEL = 100_003  # not a multiple of any shard count


def contribution(i: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()).hexdigest()[:16]


def outer_momentum(diloco: DiLoCo) -> str:
    """A digest of this rank's shards of the outer momentum (read only: the refusal test's witness)."""
    mom = diloco._p2p.opt.momentum() if diloco._p2p is not None else None
    return "none" if mom is None else hashlib.sha256(mom.numpy().tobytes()).hexdigest()[:16]


def rounds(mode: str, region: str, rank: int, store: dist.TCPStore, members: list[tuple[str, int]], compression: str, out: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = [g for g, _ in members]
    n = dict(members)[region]
    group = None
    if n > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[8]}", rank=rank, world_size=n)
        group = dist.group.WORLD
    torch.manual_seed(names.index(region) * 100 + rank + 1 if mode in ("first", "late", "forge0") else 0)
    big = mode in ("rejoin", "first", "late", "forge0")
    width = int(os.environ.get("P2P_WIDTH", "8192")) if big else 64  # P2P_WIDTH: measurements at other sizes
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(), torch.nn.Linear(width, 8))
    again = len(sys.argv) > 9 and sys.argv[9] == "again"
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    join_s = 4.0 if mode == "late" else 300.0
    sync = OuterSync(outer_steps=2, transport="p2p", streams=2, compression=compression, round_timeout_s=20.0, join_timeout_s=join_s)

    def corrupt(r: int, s: int, t: torch.Tensor) -> None:
        if mode == "forge0" and region == "us-east-1" and r == 0:
            t.add_(1e-3)
        if mode == "mac" and region == "eu-west-1" and rank == 0 and r == 2:
            t.add_(1.0)
        if mode in ("kill", "rejoin", "stop") and region == "ap-southeast-1" and r == 2 and not again:
            Path(out, f"killed-{region}-{rank}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)

    secret = read_secret(Path(out, "secret"))
    diloco = DiLoCo(model, sync, region, names, group=group, secret=secret, ranks=[k for _, k in members], corrupt=corrupt)
    if mode == "late" and region == "ap-southeast-1":
        time.sleep(8.0)  # round 0 closes 4 s after the others are ready
    before, started = digest(model), time.time()
    try:
        joined = diloco.join(store)
    except OuterSyncError as e:
        Path(out, f"{region}-{rank}.refused").write_text(str(e))
        sys.exit(3)
    if mode == "late" and region != "ap-southeast-1":
        time.sleep(6.0)  # round 1 closes well after round 0: ap-southeast-1 comes in between
    if mode in ("first", "late", "forge0"):
        doc = {"before": before, "after": digest(model), "store_bytes": diloco.join_store_bytes, "bytes_read": joined.bytes_read}
        doc["join_s"] = time.time() - started
        Path(out, f"{region}-{rank}.join.json").write_text(json.dumps({**doc, "round": joined.round, "created": joined.created}))
    g = torch.Generator().manual_seed(names.index(region) * 100 + rank)
    total = {"mac": 3, "kill": 4, "stop": 4, "rejoin": 10, "first": 2, "late": 8, "forge0": 2}[mode]
    first = joined.round * 2 if again or mode == "late" else 0  # a region that (re)joins late counts steps from the job's round
    with Path(out, f"{region}-{rank}.jsonl").open("a") as f:
        for step in range(first + 1, 2 * total + 1):
            if mode in ("rejoin", "late"):
                time.sleep(0.5)
            x = torch.randn(16, 32, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :8])
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept = {"digest_before": digest(model), "momentum_before": outer_momentum(diloco)} if mode == "mac" else {}
            rec = diloco.maybe_sync(step)
            if rec is not None:
                if kept:
                    kept["momentum"] = outer_momentum(diloco)
                f.write(json.dumps({**rec.to_dict(), "time": time.time(), "digest": digest(model), **kept}) + "\n")
                f.flush()
    diloco.leave()


def main() -> None:
    mode, region, rank, port, spec, compression, out = sys.argv[1:8]
    members = [(g, int(n)) for g, n in (x.split(":") for x in spec.split(","))]
    names = [g for g, _ in members]
    store = CountingStore(dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=datetime.timedelta(seconds=60)))
    if mode != "sum":
        rounds(mode, region, int(rank), store.inner, members, compression, out)
        return
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
