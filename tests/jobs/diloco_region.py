"""Run by tests/test_diloco.py: the ranks of one region of a DiLoCo job. Each region is its own
gloo world (its own rendezvous port), and the region leaders meet in the test's TCPStore.

argv: MODE REGION REGION_RANK REGION_SIZE REGION_PORT STORE_PORT OUT
  equiv  H=1, outer lr 1 and momentum 0, inner SGD: rank 0 of the first region also trains the
         synchronous data-parallel reference on the whole global batch and writes the distance;
         then the same with outer lr 0.7 (which must not match)
  loss   H=5, inner AdamW, the paper's outer settings and fp16; each region writes the eval loss per round
  trust  H=5 under the default prefix, where the test planted values before the regions joined
  With DILOCO_TRANSPORT=p2p in the environment (and DILOCO_RANKS, each region's rank count in
  REGIONS' order, e.g. 2,1) the rounds go peer to peer (every rank meets the others through the store).
  chaos  paced rounds until the store holds ``stop``; one JSON line per round (pid, digest of the
         parameters) in OUT/REGION-RANK.jsonl; the test kills and restarts a region
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.trainer.diloco import DiLoCo, OuterSync, RoundRecord, connect_store
from geoshard.trainer.diloco.auth import read_secret
from geoshard.trainer.exit import exit_rank

REGIONS = ("us-east-1", "eu-west-1")
IN, OUT_CLASSES, REGION_BATCH = 16, 4, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, OUT_CLASSES))


def teacher() -> torch.Tensor:
    return torch.randn(IN, OUT_CLASSES, generator=torch.Generator().manual_seed(1234))


def batch(region: str, rank: int, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's share of its region's batch of ``REGION_BATCH`` (labels from a fixed linear teacher: learnable)."""
    g = torch.Generator().manual_seed(hash((REGIONS.index(region), rank, step)) % (2**31))
    x = torch.randn(REGION_BATCH // size, IN, generator=g)
    return x, (x @ teacher()).argmax(1)


def digest(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def record(rec: RoundRecord | None) -> dict[str, Any]:
    return {} if rec is None else rec.to_dict()


class Region:
    def __init__(self, argv: list[str]) -> None:
        self.mode, self.region = argv[0], argv[1]
        self.rank, self.size, port, self.store_port = int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
        self.out = Path(argv[6])
        self.secret = read_secret(self.out / "outer-secret")  # the test's job secret, as a launcher hands it out
        self.group: Any = None
        if self.size > 1:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=self.size, timeout=datetime.timedelta(seconds=60)
            )
            self.group = dist.group.WORLD
        self.transport = os.environ.get("DILOCO_TRANSPORT", "store")
        self.ranks = [int(n) for n in os.environ.get("DILOCO_RANKS", "1,1").split(",")]
        p2p = self.transport == "p2p"
        self.store = connect_store("127.0.0.1", self.store_port, timeout_s=30) if self.rank == 0 or p2p else None

    def trainer(self, sync: OuterSync, prefix: str, lr: float, adamw: bool = False) -> tuple[nn.Module, nn.Module, DiLoCo]:
        model = make_model()
        wrapped = DDP(model, process_group=self.group) if self.group is not None else model
        sync = dataclasses.replace(sync, transport=self.transport)
        ranks = self.ranks if self.transport == "p2p" else None
        diloco = DiLoCo(model, sync, self.region, REGIONS, group=self.group, prefix=prefix, secret=self.secret, ranks=ranks)
        self.joined = diloco.join(self.store)
        params = list(model.parameters())
        self.opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr) if adamw else torch.optim.SGD(params, lr=lr)
        return model, wrapped, diloco

    def inner_step(self, wrapped: nn.Module, step: int) -> float:
        x, y = batch(self.region, self.rank, self.size, step)
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def equiv(job: Region) -> None:
    steps, inner_lr = 8, 0.1
    result: dict[str, Any] = {}
    for name, outer_lr in (("lr1", 1.0), ("lr07", 0.7)):
        sync = OuterSync(outer_steps=1, outer_lr=outer_lr, outer_momentum=0.0, compression="none", round_timeout_s=60)
        model, wrapped, diloco = job.trainer(sync, name, inner_lr)
        records = []
        for step in range(1, steps + 1):
            job.inner_step(wrapped, step)
            records.append(record(diloco.maybe_sync(step)))
        result[name] = {"digest": digest(model), "records": records}
        if job.region == REGIONS[0] and job.rank == 0:
            ref = make_model()
            opt = torch.optim.SGD(ref.parameters(), lr=inner_lr)
            for step in range(1, steps + 1):
                parts = [batch(region, r, n, step) for region, n in ((REGIONS[0], job.size), (REGIONS[1], 1)) for r in range(n)]
                x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                opt.zero_grad()
                F.cross_entropy(ref(x), y).backward()
                opt.step()
            diff = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
            result[name]["max_abs_diff_to_sync_dp"] = diff
            result[name]["param_scale"] = max(float(p.detach().abs().max()) for p in ref.parameters())
    (job.out / f"equiv-{job.region}-{job.rank}.json").write_text(json.dumps(result, indent=1))


def evaluator(model: nn.Module) -> Callable[[], float]:
    """The model's loss on 512 fixed inputs labelled by the teacher."""
    g = torch.Generator().manual_seed(99)
    ex = torch.randn(512, IN, generator=g)
    ey = (ex @ teacher()).argmax(1)

    def eval_loss() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(ex), ey))

    return eval_loss


def loss(job: Region) -> None:
    sync = OuterSync(outer_steps=5, compression="fp16", round_timeout_s=60)
    model, wrapped, diloco = job.trainer(sync, "loss", lr=1e-2, adamw=True)  # the paper's inner optimizer
    eval_loss = evaluator(model)
    losses, records = [eval_loss()], []
    for step in range(1, 51):
        job.inner_step(wrapped, step)
        rec = diloco.maybe_sync(step)
        if rec is not None:
            losses.append(eval_loss())
            records.append(record(rec))
    (job.out / f"loss-{job.region}.json").write_text(json.dumps({"eval_loss": losses, "records": records, "digest": digest(model)}))


class SlowStore:
    """The store as if an ocean away: every call waits ``delay`` seconds first."""

    def __init__(self, store: Any, delay: float) -> None:
        self.store, self.delay = store, delay

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(self.delay)
            return method(*args, **kwargs)

        return slow


def overlap(job: Region) -> None:
    """H=10 with the exchange 8 steps behind training, through a store 20 ms away per call."""
    sync = OuterSync(outer_steps=10, overlap_steps=8, compression="fp16", round_timeout_s=60)
    if job.store is not None:
        job.store = SlowStore(job.store, 0.02)  # type: ignore[assignment]
    model, wrapped, diloco = job.trainer(sync, "overlap", lr=1e-2, adamw=True)
    eval_loss = evaluator(model)
    losses, records = [eval_loss()], []
    for step in range(1, 101):
        job.inner_step(wrapped, step)
        time.sleep(0.05)  # compute for the exchange to hide behind
        rec = diloco.maybe_sync(step)
        if step == 100:
            assert rec is None
            rec = diloco.finish()  # the last round, started at step 100
        if rec is not None:
            losses.append(eval_loss())
            records.append(record(rec))
    result = {"eval_loss": losses, "records": records, "digest": digest(model)}
    (job.out / f"overlap-{job.region}-{job.rank}.json").write_text(json.dumps(result))


def trust(job: Region) -> None:
    """H=5, 40 steps under the default prefix ``diloco``, where the test planted values of its own
    before the regions joined; with ``NAN_AT`` in the environment, eu-west-1's parameters turn NaN
    after that step (its own pseudo-gradient is non-finite at the next round)."""
    sync = OuterSync(outer_steps=5, compression="fp16", round_timeout_s=20, join_timeout_s=60)
    model, wrapped, diloco = job.trainer(sync, "diloco", lr=0.05)
    nan_at = int(os.environ.get("NAN_AT", "0"))
    losses, records = [], []
    for step in range(1, 41):
        losses.append(job.inner_step(wrapped, step))
        if step == nan_at and job.region == REGIONS[1]:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        rec = diloco.maybe_sync(step)
        if rec is not None:
            records.append(record(rec))
    diloco.leave()
    result = {"losses": losses, "records": records, "digest": digest(model), "join_refused": job.joined.refused}
    (job.out / f"trust-{job.region}.json").write_text(json.dumps(result))


def chaos(job: Region) -> None:
    sync = OuterSync(outer_steps=5, compression="fp16", round_timeout_s=3.0, join_timeout_s=60)
    model, wrapped, diloco = job.trainer(sync, "chaos", lr=0.05)
    log = (job.out / f"{job.region}-{job.rank}.jsonl").open("a")

    def write(line: dict[str, Any]) -> None:
        log.write(json.dumps({"pid": os.getpid(), "digest": digest(model), **line}) + "\n")
        log.flush()

    write({"join": diloco.round - 1})
    for step in range(1, 4000):
        job.inner_step(wrapped, step)
        time.sleep(0.02)  # paced, so that the test can kill and restart a region mid-run
        rec = diloco.maybe_sync(step)
        if rec is not None:
            write(record(rec))
            stop = [job.store.check(["chaos/stop"]) if job.store is not None else None]
            if job.group is not None:
                dist.broadcast_object_list(stop, group=job.group, group_src=0)
            if stop[0]:
                break
    log.close()


def main() -> None:
    faulthandler.enable()  # a C++ abort (SIGABRT) prints where each Python thread was
    job = Region(sys.argv[1:])
    {"equiv": equiv, "loss": loss, "chaos": chaos, "overlap": overlap, "trust": trust}[job.mode](job)
    if job.group is not None:
        dist.destroy_process_group()
    exit_rank(0)  # DDP keeps gloo's threads alive into finalization (trainer/exit.py)


if __name__ == "__main__":
    main()
