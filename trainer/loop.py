"""The DDP training loop of one rank, with the time of every step split into data wait, compute,
gradient sync and checkpointing.

Data wait is the time blocked in ``next(loader)``: the share of the loop's wall time it takes is
what geoshard promises to keep under the budget. Each step's record goes to
``RUN_DIR/steps-rank{R}.jsonl`` as it happens (a killed rank still leaves its history), the rank's
summary to ``RUN_DIR/rank{R}.json`` at the end; rank 0 then writes the report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from geoshard.loaders import RegionalLoader, make_loader
from geoshard.trainer.checkpoint import CheckpointStore
from geoshard.trainer.comm import CommState, timed_allreduce_hook
from geoshard.trainer.config import TrainConfig
from geoshard.trainer.metrics import Metrics
from geoshard.trainer.model import Net, collate, to_tensors
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.errors import DataError

log = logging.getLogger(__name__)


def network_environment(cfg: TrainConfig) -> dict[str, str]:
    """Variables NCCL and gloo read at initialization (long-link advice made reachable)."""
    env = {}
    if cfg.nccl_algo:
        env["NCCL_ALGO"] = cfg.nccl_algo
    if cfg.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = cfg.socket_ifname
    return env


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def gpu_utilization() -> float | None:
    if not torch.cuda.is_available():
        return None
    try:
        return float(torch.cuda.utilization())
    except Exception:  # needs NVML (pynvml); absent on some images
        return None


def forward_backward(ddp: DDP, x: torch.Tensor, y: torch.Tensor, accum_steps: int, last: bool) -> float:
    """One micro-batch: gradients add up locally, and only the last one of a step all-reduces."""
    with contextlib.nullcontext() if last else ddp.no_sync():
        loss = F.cross_entropy(ddp(x), y) / accum_steps
        loss.backward()
    return float(loss.detach())


def _keep_steps(path: Path, upto: int) -> None:
    """After a resume, forget the records of steps that are about to be redone."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            if json.loads(line)["step"] <= upto:
                kept.append(line + "\n")
    path.write_text("".join(kept))


def train(cfg: TrainConfig) -> dict[str, Any]:
    os.environ.update(network_environment(cfg))
    backend = pick_backend(cfg.backend)
    dist.init_process_group(backend)
    try:
        return _train(cfg, backend)
    finally:
        dist.destroy_process_group()


def _train(cfg: TrainConfig, backend: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)

    model = Net(cfg.hidden).to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    comm = CommState(cfg.grad_compression, cfg.fp32_after)
    ddp.register_comm_hook(comm, timed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=0.9)
    loader = make_loader(
        cfg.plan,
        region=cfg.region,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        collate_fn=collate,
        seed=cfg.seed,
        prefetch=cfg.prefetch,
        shuffle_buffer=cfg.shuffle_buffer,
        allow_cross_region=cfg.allow_cross_region,
    )
    store = CheckpointStore(cfg.checkpoint_target, keep=cfg.checkpoint_keep, endpoint_url=cfg.checkpoint_endpoint)
    step = 0
    if cfg.resume and (latest := store.load_latest()) is not None:
        step, state = latest
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loaders"][rank])
        log.warning("rank %d: resumed at step %d (epoch %d)", rank, step, loader.dataset.epoch)
    steps_path = cfg.out / f"steps-rank{rank}.jsonl"
    keys_path = cfg.out / f"keys-rank{rank}.jsonl"
    for p in (steps_path, keys_path):
        if step:
            _keep_steps(p, step)
        else:
            p.unlink(missing_ok=True)
    metrics = Metrics(None if cfg.metrics_port is None else cfg.metrics_port + rank, rank=rank, region=loader.dataset.region)
    with open(steps_path, "a") as steps_log, open(keys_path, "a") if cfg.log_keys else contextlib.nullcontext() as keys_log:
        summary = _loop(cfg, rank, world, step, ddp, comm, opt, loader, store, metrics, steps_log, keys_log, device)
    metrics.close()
    summary.update(backend=backend, device=str(device), world_size=world, region=loader.dataset.region)
    Path(cfg.out / f"rank{rank}.json").write_text(json.dumps(summary, indent=1))
    dist.barrier()
    if rank == 0:
        from geoshard.trainer.report import build_report, write_report

        write_report(cfg.out, build_report(cfg.out, cfg.budget))
    return summary


def _loop(
    cfg: TrainConfig,
    rank: int,
    world: int,
    step: int,
    ddp: DDP,
    comm: CommState,
    opt: torch.optim.Optimizer,
    loader: RegionalLoader,
    store: CheckpointStore,
    metrics: Metrics,
    steps_log: TextIO,
    keys_log: TextIO | None,
    device: torch.device,
) -> dict[str, Any]:
    if len(loader) == 0:
        raise DataError(f"rank {rank}: this rank's share of region {loader.dataset.region} is empty")
    batches = loader.stream()  # epoch after epoch; the next epoch's workers start before this one ends
    clock = time.perf_counter
    t_loop = clock()
    first_batch: float | None = None
    samples = 0
    start_step = step
    while step < cfg.steps:
        t_step = clock()
        wait = compute = 0.0
        loss_sum = 0.0
        keys: list[str] = []
        n = 0
        opt.zero_grad(set_to_none=True)
        comm.step = step
        for micro in range(cfg.accum_steps):
            t0 = clock()
            batch = next(batches)
            t1 = clock()
            wait += t1 - t0
            if first_batch is None:
                first_batch = t1 - t_loop
            x, y = to_tensors(batch, device)
            loss_sum += forward_backward(ddp, x, y, cfg.accum_steps, last=micro == cfg.accum_steps - 1)
            n += len(y)
            keys += batch["keys"]
            compute += clock() - t1
        t2 = clock()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compute += clock() - t2
        step += 1
        samples += n
        if keys_log is not None:  # before the checkpoint: a resume after it never redoes this step
            keys_log.write(json.dumps({"step": step, "keys": keys}) + "\n")
            keys_log.flush()
        ckpt = 0.0
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            ckpt = _checkpoint(step, rank, ddp, opt, loader, store)
        record = {
            "step": step,
            "rank": rank,
            "t": clock() - t_loop,
            "data_wait_s": wait,
            "compute_s": compute,
            "comm_s": comm.take(),
            "checkpoint_s": ckpt,
            "step_s": clock() - t_step,
            "loss": loss_sum,
            "samples": n,
        }
        steps_log.write(json.dumps(record) + "\n")
        steps_log.flush()
        if metrics.registry is not None:
            util = gpu_utilization()
            metrics.observe_step(record, loader.stats(), gpu_util=None if util is None else util / 100)
    wall = clock() - t_loop
    return {
        "rank": rank,
        "wall_s": wall,
        "time_to_first_batch_s": first_batch if first_batch is not None else 0.0,
        "steps": step - start_step,
        "samples": samples,
        "loader": loader.stats(),
        "gpu_util": gpu_utilization(),
    }


def _checkpoint(step: int, rank: int, ddp: DDP, opt: torch.optim.Optimizer, loader: RegionalLoader, store: CheckpointStore) -> float:
    """Rank 0 writes model, optimizer and every rank's loader position; the others wait for it."""
    t0 = time.perf_counter()
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader.state_dict())
    if rank == 0:
        store.save(step, {"step": step, "model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "loaders": states})
    dist.barrier()
    return time.perf_counter() - t0
