"""Run by tests/test_diloco_p2p_quantized.py: one rank of one region in the int8 / fp8 exchange over
the peer-to-peer transport (trainer/diloco/quantized.py), around a TCPStore the test hosts on 127.0.0.1.

argv: MODE REGION RANK STORE_PORT MEMBERS COMPRESSION OUT REGION_PORT [AGAIN]
  sum     ``quantized_allreduce`` of randn(NUMEL) seeded by the region's index in MEMBERS: the
          result (OUT/REGION-RANK.pt) and the bytes sent and the store's bytes (OUT/REGION-RANK.json)
  forge   DiLoCo (transport p2p, H=2) for 3 rounds; eu-west-1's rank 0 changes one byte of what
          it sends in round 2's first step, after the digests were taken (a tamperer on the wire)
  resume  DiLoCo for 4 rounds; after round 2 every rank takes the region's error feedback state
          (as a checkpoint does), forgets its residual, loads the state back, and writes whether
          its residual came back bit for bit, and the state, to OUT/REGION-RANK.resume.json
  overlap DiLoCo (H=4, --outer-overlap 2) for 5 rounds
  tiny    DiLoCo (H=2, 4 streams) for 4 rounds of a 7-parameter model: with 3 shards some stream
          chunks hold 1 or 2 values, fewer than the 3 member regions (empty or one-value parts)
  rejoin  DiLoCo for 10 rounds paced by 0.4 s a step, a model of 84k parameters; every rank saves
          its region's error feedback state after round 2 (OUT/REGION.ckpt.pt, as a checkpoint
          does); ap-southeast-1 writes the time and SIGKILLs itself in round 3's exchange.
          Started again with AGAIN=again, it rejoins, loads that state after join if the file is
          there (as the trainer's resume does; else its residual starts at zero, as a plain
          restart's) and takes part until the others finish
  Each DiLoCo rank appends its round records (with the time and a digest of its model) to
  OUT/REGION-RANK.jsonl. In overlap, tiny and rejoin every exchange's inputs and outputs go to
  OUT/REGION-RANK.ex.pt (``record``). A region of several ranks is its own gloo world on
  127.0.0.1:REGION_PORT.
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
from typing import Any

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


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()).hexdigest()[:16]


def make_model(mode: str) -> torch.nn.Module:
    if mode == "tiny":  # 2*1 + 1 + 1*2 + 2 = 7 parameters
        return torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Linear(1, 2))
    width = 2048 if mode == "rejoin" else 512  # rejoin: 84k parameters, a 336 kB fp32 state
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(), torch.nn.Linear(width, 8))


def rounds(mode: str, region: str, rank: int, store: dist.TCPStore, members: list[tuple[str, int]], compression: str, out: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = [g for g, _ in members]
    if dict(members)[region] > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[8]}", rank=rank, world_size=dict(members)[region])
    group = dist.group.WORLD if dict(members)[region] > 1 else None
    again = len(sys.argv) > 9 and sys.argv[9] == "again"
    torch.manual_seed(0)
    model = make_model(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    h, k, streams = {"overlap": (4, 2, 2), "tiny": (2, 0, 4)}.get(mode, (2, 0, 2))
    sync = OuterSync(outer_steps=h, overlap_steps=k, transport="p2p", streams=streams, compression=compression, round_timeout_s=20.0)

    def corrupt(r: int, s: int, t: torch.Tensor) -> None:
        if mode == "forge" and region == "eu-west-1" and rank == 0 and r == 2 and t.numel():
            t[t.numel() // 2] ^= 1  # one bit of one byte
        if mode == "rejoin" and region == "ap-southeast-1" and r == 3 and not again:
            Path(out, f"killed-{region}-{rank}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    diloco = DiLoCo(
        model, sync, region, names, group=group, secret=read_secret(Path(out, "secret")), ranks=[k for _, k in members], corrupt=corrupt
    )
    joined = diloco.join(store)
    if again and Path(out, f"{region}.ckpt.pt").exists():  # as --resume: the checkpoint's residual after join (diloco/loop.py)
        diloco.load_feedback(torch.load(Path(out, f"{region}.ckpt.pt")))
    if mode in ("overlap", "tiny", "rejoin"):
        record(diloco, Path(out, f"{region}-{rank}.ex.pt"))
    g = torch.Generator().manual_seed(names.index(region) * 100 + rank)
    total = {"forge": 3, "resume": 4, "overlap": 5, "tiny": 4, "rejoin": 10}[mode]
    first = joined.round * h if again else 0  # a region that rejoins counts steps from the job's round
    width = 2 if mode == "tiny" else 32
    with Path(out, f"{region}-{rank}.jsonl").open("a") as f:
        for step in range(first + 1, h * total + 1):
            if mode == "rejoin":
                time.sleep(0.4)
            x = torch.randn(16, width, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, : width if mode == "tiny" else 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec = diloco.maybe_sync(step)
            if rec is not None:
                f.write(json.dumps({**rec.to_dict(), "time": time.time(), "digest": digest(model)}) + "\n")
                f.flush()
            if mode == "resume" and step == 4:
                resume(diloco, region, rank, out)
            if mode == "rejoin" and step == 4 and not again:  # after round 2: the region's checkpoint
                state = diloco.feedback_state()  # collective in the region
                if rank == 0:
                    torch.save(state, Path(out, f"{region}.ckpt.pt"))
        rec = diloco.finish()  # overlap: the round in flight after the last step
        if rec is not None:
            f.write(json.dumps({**rec.to_dict(), "time": time.time(), "digest": digest(model)}) + "\n")
    diloco.leave()


def record(diloco: DiLoCo, path: Path) -> None:
    """Every exchange this rank takes part in, saved to ``path`` as it ends: per owned shard what it
    encoded (its pseudo-gradient plus its residual, or zeros when it rejoined), the parts' cuts, the
    residual before and after, and the decoded sum; the round, attempt, members, and whether the
    exchange returned. The test recomputes each sum from the members' inputs and the codec alone."""
    q = diloco._p2p.quantized if diloco._p2p is not None else None
    assert q is not None
    encode_shard, exchange = q.encode_shard, q.exchange
    shards: dict[int, dict[str, Any]] = {}
    log: list[dict[str, Any]] = []

    def recorded_encode(s: int, delta: torch.Tensor, cuts: Any, fresh: bool) -> Any:
        before = q.residual.get(s)
        x = delta.detach().reshape(-1).float()
        if q.feedback and not fresh and before is not None:
            x = x + before
        payloads = encode_shard(s, delta, cuts, fresh)
        after = q.residual.get(s)
        shards[s] = {"x": x.clone(), "cuts": [list(c) for c in cuts], "fresh": fresh}
        shards[s].update(before=None if before is None else before.clone(), after=None if after is None else after.clone())
        return payloads

    def recorded_exchange(w: Any, chunks: Any, corrupt: Any = None) -> Any:
        rec = {"r": w.r, "attempt": w.attempt, "members": list(w.members), "me": w.me, "shards": dict(shards), "ok": False}
        shards.clear()
        log.append(rec)
        try:
            out, sent, why = exchange(w, chunks, corrupt)
        finally:
            torch.save(log, path)
        for s, parts in out.items():
            rec["shards"][s]["sum"] = torch.cat(parts)
        rec.update(ok=True, why=why)
        torch.save(log, path)
        return out, sent, why

    q.encode_shard = recorded_encode  # type: ignore[method-assign]
    q.exchange = recorded_exchange  # type: ignore[method-assign]


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
