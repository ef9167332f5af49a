"""The DDP training loop of one rank, with the time of every step split into data wait, compute,
gradient sync and checkpointing.

Data wait is the time blocked in ``next(loader)``: the share of the loop's wall time it takes is
what geoshard promises to keep under the budget. Each step's record goes to
``RUN_DIR/steps-rank{R}.jsonl`` as it happens (a killed rank still leaves its history), the rank's
summary to ``RUN_DIR/rank{R}.json`` at the end; rank 0 then writes the report.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.errors import ConfigError, DataError
from geoshard.loaders import RegionalLoader, make_loader
from geoshard.plan import load_plan
from geoshard.trainer.checkpoint import CheckpointStore
from geoshard.trainer.comm import CommState, hierarchical_hook, resolve_sync, timed_allreduce_hook
from geoshard.trainer.config import TrainConfig
from geoshard.trainer.context import RankContext
from geoshard.trainer.metrics import Metrics
from geoshard.trainer.model import Net, collate, count_collate, to_tensors
from geoshard.trainer.outer import OuterLoop
from geoshard.trainer.record import StepRecord

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
    # Check what this rank can check alone before the first collective: a rank that fails inside one
    # leaves the others waiting for it until the timeout.
    plan = load_plan(cfg.plan)
    if cfg.region is not None:
        plan.region(cfg.region)
    job = cfg.job_regions if cfg.sync == "diloco" else ()
    if cfg.sync == "diloco" and (not job or not cfg.outer_store):
        raise ConfigError("--sync diloco needs --outer-store and --outer-regions (geoshard train --regions sets both)")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.collective_timeout))
    try:
        ctx = RankContext.discover(cfg.region, backend, job=job)
        plan.region(ctx.region)
        return _train(cfg, ctx)
    finally:
        dist.destroy_process_group()


@dataclass
class Run:
    """The loop's working parts, built once by ``_train``."""

    cfg: TrainConfig
    ctx: RankContext
    ddp: DDP
    comm: CommState
    opt: torch.optim.Optimizer
    loader: RegionalLoader
    store: CheckpointStore
    outer: OuterLoop | None  # --sync diloco
    metrics: Metrics
    steps_log: TextIO
    keys_log: TextIO | None
    segment: int


def lease_name(out: Path) -> str:
    """The job's lease in each bucket (docs/guarantees.md section 8): named by its run folder, so a
    resumed run renews the lease its first segment took."""
    where = out.resolve()
    name = re.sub(r"[^A-Za-z0-9._-]", "-", where.name)[:40].lstrip("._-") or "run"
    return f"{name}-{hashlib.sha256(str(where).encode()).hexdigest()[:12]}"


def loader_key(region: str, region_rank: int) -> str:
    """A loader position is keyed by region and rank within it: a restart may renumber global ranks."""
    return f"{region}/{region_rank}"


def _train(cfg: TrainConfig, ctx: RankContext) -> dict[str, Any]:
    rank, device = ctx.rank, ctx.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)

    model = Net(cfg.hidden).to(device)
    ddp = DDP(model, device_ids=[ctx.local_rank] if device.type == "cuda" else None)
    sync = resolve_sync(cfg.sync, ctx.topology)  # diloco: plain DDP inside the region (its own world)
    comm = CommState(ctx.topology, cfg.grad_compression, cfg.fp32_after)
    ddp.register_comm_hook(comm, hierarchical_hook if sync == "hierarchical" else timed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=0.9)
    loader = make_loader(
        cfg.plan,
        topology=ctx.topology,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        collate_fn=collate if cfg.model != "none" else count_collate,
        seed=cfg.seed,
        prefetch=cfg.prefetch,
        shuffle_buffer=cfg.shuffle_buffer,
        allow_cross_region=cfg.allow_cross_region,
        follow_refresh=cfg.follow_refresh,
        lease=lease_name(cfg.out),
    )
    ds = loader.dataset
    if ctx.group_rank == 0:
        _announce(cfg, ctx, ds.balance, sync)
    # Under DiLoCo each region keeps its own checkpoints: a region restarts alone.
    target = cfg.checkpoint_target.rstrip("/") + f"/{ctx.region}" if sync == "diloco" else cfg.checkpoint_target
    store = CheckpointStore(target, keep=cfg.checkpoint_keep, endpoint_url=cfg.checkpoint_endpoint, region=cfg.checkpoint_region)
    step = 0
    resumed_outer: dict[str, Any] | None = None
    if cfg.resume and (latest := store.load_latest()) is not None:
        step, state = latest
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(_loader_state(state["loaders"], ctx.region, ds.rank, rank))
        resumed_outer = state.get("outer") or {}
        log.warning("rank %d: resumed at step %d (epoch %d; %s rank %d)", rank, step, ds.epoch, ctx.region, ds.rank)
    steps_path = cfg.out / f"steps-rank{rank}.jsonl"
    keys_path = cfg.out / f"keys-rank{rank}.jsonl"
    redone = max(0, _last_logged_step(steps_path) - step) if cfg.resume else 0  # steps this segment does again
    outer = None
    if sync == "diloco":
        outer = OuterLoop(cfg, ctx, model)
        outer.join(step, resumed_outer, redone)  # the newest outer parameters replace the checkpoint's
    for p in (steps_path, keys_path):
        if step:
            _keep_steps(p, step)
        else:
            p.unlink(missing_ok=True)
    segment = _next_segment(steps_path)
    metrics = Metrics(None if cfg.metrics_port is None else cfg.metrics_port + rank, rank=rank, region=ctx.region, host=cfg.metrics_host)
    with open(steps_path, "a") as steps_log, open(keys_path, "a") if cfg.log_keys else contextlib.nullcontext() as keys_log:
        run = Run(cfg, ctx, ddp, comm, opt, loader, store, outer, metrics, steps_log, keys_log, segment)
        summary = _loop(run, step)
    if outer is not None:
        outer.leave()
    metrics.close()
    summary.update(
        backend=ctx.backend,
        device=str(device),
        world_size=ctx.world_size,
        region=ctx.region,
        region_rank=ds.rank,
        region_size=ds.world_size,
        sync=sync,
        samples_per_epoch=ds.samples_per_epoch * ds.world_size,
        left_out_per_epoch=ds.remainder()["dropped_samples"],
        repeated_per_epoch=ds.remainder()["padded_samples"],
        region_samples=sum(s.samples for s in ds.manifest.shards),
        generations={str(e): g for e, g in sorted(ds.generations.items())},
        segment=segment,
        earlier_segments=_earlier_segments(cfg.out / f"rank{rank}.json", segment),
        egress_budget=ds.settings.egress_budget if ds.settings.egress_budget is not None else load_plan(cfg.plan).egress.budget,
        utilization_target=cfg.utilization_target,
        steps_redone=redone,
    )
    Path(cfg.out / f"rank{rank}.json").write_text(json.dumps(summary, indent=1))
    dist.barrier()
    if rank == 0 and sync != "diloco":  # under DiLoCo regions end apart: the launcher writes the report
        from geoshard.trainer.report import build_report, write_report

        write_report(cfg.out, build_report(cfg.out, cfg.budget))
    return summary


def _announce(cfg: TrainConfig, ctx: RankContext, balance: Any, sync: str) -> None:
    """Rank 0 says once where the ranks are and what each epoch leaves out or repeats."""
    if sync == "diloco":
        print(
            f"geoshard.trainer: {ctx.region}: {ctx.group_size} of the job's {ctx.world_size} rank(s); DDP in the region, "
            f"DiLoCo across {cfg.outer_regions} every {cfg.outer_steps} steps (outer lr {cfg.outer_lr:g}, "
            f"momentum {cfg.outer_momentum:g}{', Nesterov' if cfg.outer_nesterov else ''}, {cfg.outer_compression})",
            flush=True,
        )
    else:
        print(f"geoshard.trainer: {ctx.world_size} rank(s): {ctx.topology.describe()}; gradient sync {sync}", flush=True)
    if balance is not None:
        print(f"geoshard.trainer: {balance.line()}", flush=True)
        plan = load_plan(cfg.plan)
        for warning in balance.weight_warnings({r: plan.region(r).weight for r in ctx.topology.region_names}):
            log.warning("%s", warning)


def _loader_state(states: Any, region: str, region_rank: int, rank: int) -> Any:
    if isinstance(states, list):  # checkpoints of single-region versions: by global rank
        return states[rank]
    key = loader_key(region, region_rank)
    if key not in states:
        raise ConfigError(f"the checkpoint has no loader position for {key}; resume with the same ranks per region")
    return states[key]


def _earlier_segments(summary_path: Path, segment: int) -> list[dict[str, Any]]:
    """The summaries of this rank's earlier segments (a resume or restart writes the file anew), so
    the report counts the loader's work of the whole run; a segment that died left none."""
    if segment == 0:
        return []
    try:
        old = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict) or not isinstance(old.get("segment", 0), int) or old.get("segment", 0) >= segment:
        return []
    earlier = [e for e in old.pop("earlier_segments", None) or [] if isinstance(e, dict)]
    return [*earlier, old]


def _last_logged_step(steps_path: Path) -> int:
    """The newest step in the rank's step log (before a resume trims it)."""
    last = 0
    if steps_path.exists():
        for line in steps_path.read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                last = max(last, int(json.loads(line)["step"]))
    return last


def _next_segment(steps_path: Path) -> int:
    """Each start of the loop (first run, resume, restart) is a new segment of the step log."""
    last = -1
    if steps_path.exists():
        for line in steps_path.read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                last = max(last, int(json.loads(line).get("segment", 0)))
    return last + 1


def _loop(run: Run, step: int) -> dict[str, Any]:
    cfg, ctx, loader, comm = run.cfg, run.ctx, run.loader, run.comm
    if len(loader) == 0:
        raise DataError(f"rank {ctx.rank}: this rank's share of region {ctx.region} is empty")
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
        run.opt.zero_grad(set_to_none=True)
        comm.step = step
        for micro in range(cfg.accum_steps):
            t0 = clock()
            batch = next(batches)
            t1 = clock()
            wait += t1 - t0
            if first_batch is None:
                first_batch = t1 - t_loop
            if cfg.model == "none":  # the data path alone: the batch is consumed, --step-time is the compute
                n += batch["n"]
            else:
                x, y = to_tensors(batch, ctx.device)
                loss_sum += forward_backward(run.ddp, x, y, cfg.accum_steps, last=micro == cfg.accum_steps - 1)
                n += len(y)
            keys += batch["keys"]
            compute += clock() - t1
        t2 = clock()
        if cfg.model != "none":
            run.opt.step()
        if cfg.step_time:
            time.sleep(cfg.step_time)  # stated compute: no model, or a larger one than the built-in MLP
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        compute += clock() - t2
        step += 1
        samples += n
        if run.keys_log is not None:  # before the checkpoint: a resume after it never redoes this step
            ds = loader.dataset  # the epoch and generation of this step's (last) batch
            record_keys = {"step": step, "region": ctx.region, "epoch": ds.epoch, "generation": ds.manifest.generation, "keys": keys}
            run.keys_log.write(json.dumps(record_keys) + "\n")
            run.keys_log.flush()
        t_outer = clock()
        if run.outer is not None:  # before the checkpoint, so one taken at a round holds its result
            run.outer.after_step(step)
            if step == cfg.steps:
                run.outer.finish()  # a round still in flight (--outer-overlap), in this step's time
        outer_s = clock() - t_outer if run.outer is not None else 0.0
        ckpt = 0.0
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            ckpt = _checkpoint(step, run)
        comm_s, intra_s, cross_s, cross_bytes = comm.take()
        record = StepRecord(
            step=step,
            rank=ctx.rank,
            t=clock() - t_loop,
            data_wait_s=wait,
            compute_s=compute,
            step_s=clock() - t_step,
            comm_s=comm_s,
            comm_intra_s=intra_s,
            comm_cross_s=cross_s,
            checkpoint_s=ckpt,
            outer_sync_s=outer_s,
            cross_region_grad_bytes=cross_bytes,
            loss=loss_sum if cfg.model != "none" else None,
            samples=n,
            region=ctx.region,
            segment=run.segment,
        )
        run.steps_log.write(json.dumps(record.to_json()) + "\n")
        run.steps_log.flush()
        if run.metrics.registry is not None:
            util = gpu_utilization()
            run.metrics.observe_step(record, loader.stats(), gpu_util=None if util is None else util / 100)
    wall = clock() - t_loop
    return {
        "rank": ctx.rank,
        "wall_s": wall,
        "time_to_first_batch_s": first_batch if first_batch is not None else 0.0,
        "steps": step - start_step,
        "samples": samples,
        "loader": loader.stats(),
        "gpu_util": gpu_utilization(),
    }


def _checkpoint(step: int, run: Run) -> float:
    """Rank 0 writes model, optimizer and every rank's loader position; the others wait for it."""
    t0 = time.perf_counter()
    ds = run.loader.dataset
    states: list[Any] = [None] * run.ctx.group_size
    dist.all_gather_object(states, (loader_key(ds.region, ds.rank), run.loader.state_dict()))
    if run.ctx.group_rank == 0:
        state = {"step": step, "model": run.ddp.module.state_dict(), "optimizer": run.opt.state_dict(), "loaders": dict(states)}
        if run.outer is not None:
            state["outer"] = run.outer.state()
        run.store.save(step, state)
    dist.barrier()
    return time.perf_counter() - t0
