"""Run by tests/test_diloco_p2p_quantized.py: one rank of one region in the int8 / fp8 exchange over
the peer-to-peer transport (trainer/diloco/quantized.py), around a TCPStore the test hosts on 127.0.0.1.

argv: MODE REGION RANK STORE_PORT MEMBERS COMPRESSION OUT REGION_PORT
  sum     ``quantized_allreduce`` of randn(NUMEL) seeded by the region's index in MEMBERS: the
          result (OUT/REGION-RANK.pt) and the bytes sent and the store's bytes (OUT/REGION-RANK.json)
  forge   DiLoCo (transport p2p, H=2) for 3 rounds; eu-west-1's rank 0 changes one byte of what
          it sends in round 2's first step, after the digests were taken (a tamperer on the wire)
  resume  DiLoCo for 4 rounds; after round 2 every rank takes the region's error feedback state
          (as a checkpoint does), forgets its residual, loads the state back, and writes whether
          its residual came back bit for bit, and the state, to OUT/REGION-RANK.resume.json
  Each DiLoCo rank appends its round records to OUT/REGION-RANK.jsonl. A region of several ranks
  is its own gloo world on 127.0.0.1:REGION_PORT.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from geoshard.trainer.diloco import DiLoCo, OuterSync
from geoshard.trainer.diloco.auth import Signer, read_secret
from geoshard.trainer.diloco.codec import codec
from geoshard.trainer.diloco.groups import CountingStore
from geoshard.trainer.diloco.kv import KV
from geoshard.trainer.diloco.quantized import quantized_allreduce

NUMEL = 100_003  # not a multiple of any shard count, nor of the codec's block


def contribution(i: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) * (1 + i)


def rounds(mode: str, region: str, rank: int, store: dist.TCPStore, members: list[tuple[str, int]], compression: str, out: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = [g for g, _ in members]
    if dict(members)[region] > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[8]}", rank=rank, world_size=dict(members)[region])
    group = dist.group.WORLD if dict(members)[region] > 1 else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = OuterSync(outer_steps=2, transport="p2p", streams=2, compression=compression, round_timeout_s=20.0)

    def corrupt(r: int, s: int, t: torch.Tensor) -> None:
        if mode == "forge" and region == "eu-west-1" and rank == 0 and r == 2 and t.numel():
            t[t.numel() // 2] ^= 1  # one bit of one byte

    diloco = DiLoCo(
        model, sync, region, names, group=group, secret=read_secret(Path(out, "secret")), ranks=[k for _, k in members], corrupt=corrupt
    )
    diloco.join(store)
    g = torch.Generator().manual_seed(names.index(region) * 100 + rank)
    total = {"forge": 3, "resume": 4}[mode]
    with Path(out, f"{region}-{rank}.jsonl").open("a") as f:
        for step in range(1, 2 * total + 1):
            x = torch.randn(16, 32, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :8])
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec = diloco.maybe_sync(step)
            if rec is not None:
                f.write(json.dumps(rec.to_dict()) + "\n")
                f.flush()
            if mode == "resume" and step == 4:
                resume(diloco, region, rank, out)
    diloco.leave()


def resume(diloco: DiLoCo, region: str, rank: int, out: str) -> None:
    """What a checkpoint keeps and a resumed rank loads: its shards' residual, bit for bit."""
    q = diloco._p2p.quantized if diloco._p2p is not None else None
    assert q is not None
    before = {s: t.clone() for s, t in q.residual.items()}
    state = diloco.feedback_state()  # collective in the region
    q.residual = {}
    diloco.load_feedback(state)
    same = sorted(before) == sorted(q.residual) and all(torch.equal(before[s], q.residual[s]) for s in before)
    residual = state["residual"]
    doc = {"same": same, "codec": state["codec"], "numel": residual.numel(), "shards": sorted(before)}
    doc["nonzero"] = float(residual.abs().max())
    Path(out, f"{region}-{rank}.resume.json").write_text(json.dumps(doc))
    torch.save(residual, Path(out, f"{region}-{rank}.residual.pt"))


def main() -> None:
    mode, region, rank, port, spec, compression, out = sys.argv[1:8]
    members = [(g, int(n)) for g, n in (x.split(":") for x in spec.split(","))]
    names = [g for g, _ in members]
    raw = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    if mode != "sum":
        rounds(mode, region, int(rank), raw, members, compression, out)
        return
    store = CountingStore(raw)
    kv = KV(store, "test/q", Signer(read_secret(Path(out, "secret"))))
    mine = contribution(names.index(region))
    got, sent = quantized_allreduce(store, kv, members, region, int(rank), mine, codec(compression), streams=3, tag="test/sum")
    torch.save(got, Path(out, f"{region}-{rank}.pt"))
    Path(out, f"{region}-{rank}.json").write_text(json.dumps({"sent": sent, "store_bytes": store.carried, "numel": got.numel()}))


if __name__ == "__main__":
    main()
