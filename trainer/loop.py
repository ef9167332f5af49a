"""The DDP training loop of one rank, with the time of every step split into data wait, compute,
gradient sync and checkpointing.

Data wait is the time blocked in ``next(loader)``: the share of the loop's wall time it takes is
what geoshard promises to keep under the budget. Each step's record goes to
``RUN_DIR/steps-rank{R}.jsonl`` as it happens (a killed rank still leaves its history), the rank's
summary to ``RUN_DIR/rank{R}.json`` at the end; rank 0 then writes the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.errors import ConfigError, DataError
from geoshard.loaders import RegionalDataset, RegionalLoader, make_loader
from geoshard.plan import load_plan
from geoshard.trainer.checkpoint import CheckpointStore, loader_position
from geoshard.trainer.comm import CommState, for_sync, resolve_sync
from geoshard.trainer.config import TrainConfig
from geoshard.trainer.context import RankContext
from geoshard.trainer.diloco.generations import RegionGenerations
from geoshard.trainer.diloco.loop import OuterLoop
from geoshard.trainer.listen import process_group_store
from geoshard.trainer.metrics import Metrics
from geoshard.trainer.model import ModelInput, Net, count_collate, to_tensors
from geoshard.trainer.optim import check_resumed, inner_optimizer, set_lr
from geoshard.trainer.rankorder import job_rank_from
from geoshard.trainer.record import StepRecord, append_step
from geoshard.trainer.runlog import RunLogs
from geoshard.trainer.summary import LoaderSummary, RankSummary

log = logging.getLogger(__name__)


def network_environment(cfg: TrainConfig) -> dict[str, str]:
    """Variables NCCL and gloo read at initialization (long-link advice made reachable)."""
    env = {}
    if cfg.nccl_algo:
        env["NCCL_ALGO"] = cfg.nccl_algo
    if cfg.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = cfg.socket_ifname
    return env


def start_environment(cfg: TrainConfig, environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment the rank must start in for NCCL and gloo to see ``network_environment(cfg)``
    (they read the process environment, in C++); None when ``environ`` already is one."""
    net = network_environment(cfg)
    if all(environ.get(k) == v for k, v in net.items()):
        return None
    return {**environ, **net}


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


def forward_backward(net: nn.Module, x: torch.Tensor, y: torch.Tensor, accum_steps: int, last: bool) -> float:
    """One micro-batch: gradients add up locally, and only the last one of a step all-reduces
    (``net`` is DDP, or the model alone in a group of one rank: nothing to all-reduce)."""
    with net.no_sync() if isinstance(net, DDP) and not last else contextlib.nullcontext():
        loss = F.cross_entropy(net(x), y) / accum_steps
        loss.backward()
    return float(loss.detach())


def train(cfg: TrainConfig, started_at: float | None = None) -> RankSummary:
    """One rank's training; NCCL and gloo read ``network_environment(cfg)`` from the process
    environment, which the rank must start with (``python -m geoshard.trainer`` sees to it)."""
    backend = pick_backend(cfg.backend)
    # Check what this rank can check alone before the first collective: a rank that fails inside one
    # leaves the others waiting for it until the timeout.
    plan = load_plan(cfg.plan)
    if cfg.region is not None:
        plan.region(cfg.region)
    job = cfg.job_regions if cfg.sync == "diloco" else ()
    if cfg.sync == "diloco" and (not job or not cfg.outer_store):
        raise ConfigError("--sync diloco needs --outer-store and --outer-regions (geoshard train --regions sets both)")
    # Rank 0 serves the group's store on MASTER_ADDR only (trainer/listen.py), not torchrun's on every address.
    store, rank, world = process_group_store(os.environ, cfg.collective_timeout)
    if cfg.rank_regions:  # the job's own numbering, not the order the agents met in
        rank = job_rank_from(cfg.rank_regions, cfg.region, os.environ, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.collective_timeout))
    try:
        ctx = RankContext.discover(cfg.region, backend, job=job)
        plan.region(ctx.region)
        return _train(cfg, ctx, started_at)
    finally:
        dist.destroy_process_group()


@dataclass
class Run:
    """The loop's working parts, built once by ``_train``."""

    cfg: TrainConfig
    ctx: RankContext
    model: Net
    net: nn.Module  # what forward and backward run on: DDP, or ``model`` itself in a group of one rank
    comm: CommState
    opt: torch.optim.Optimizer
    loader: RegionalLoader
    store: CheckpointStore
    outer: OuterLoop | None  # --sync diloco
    metrics: Metrics
    steps_log: TextIO
    keys_log: TextIO | None
    segment: int
    started_at: float | None  # the process's start on the wall clock


def lease_name(out: Path) -> str:
    """The job's lease in each bucket (docs/guarantees.md section 11): named by its run folder, so a
    resumed run renews the lease its first segment took."""
    where = out.resolve()
    name = re.sub(r"[^A-Za-z0-9._-]", "-", where.name)[:40].lstrip("._-") or "run"
    return f"{name}-{hashlib.sha256(str(where).encode()).hexdigest()[:12]}"


def loader_key(region: str, region_rank: int) -> str:
    """A loader position is keyed by region and rank within it: a restart may renumber global ranks."""
    return f"{region}/{region_rank}"


def _train(cfg: TrainConfig, ctx: RankContext, started_at: float | None) -> RankSummary:
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = Net(cfg.hidden).to(ctx.device)
    sync = resolve_sync(cfg.sync, ctx.topology)  # diloco: plain DDP inside the region (its own world)
    comm = CommState(ctx.topology, cfg.grad_compression, cfg.fp32_after)
    net = for_sync(model, comm, sync, ctx.group_size, [ctx.local_rank] if ctx.device.type == "cuda" else None)
    opt = inner_optimizer(cfg, model.parameters())
    loader = _make_loader(cfg, ctx)
    if ctx.group_rank == 0:
        _announce(cfg, ctx, loader.dataset.balance, sync)
    target = cfg.region_checkpoint_target(ctx.region) if sync == "diloco" else cfg.checkpoint_target
    store = CheckpointStore(target, keep=cfg.checkpoint_keep, endpoint_url=cfg.checkpoint_endpoint, region=cfg.checkpoint_region)
    step, resumed_outer = _resume(cfg, ctx, model, opt, loader, store)
    logs = RunLogs(cfg.out, ctx.rank)
    redone = max(0, logs.last_step() - step) if cfg.resume else 0  # steps this segment does again
    outer = None
    if sync == "diloco" and cfg.model != "none":  # no model: no pseudo-gradients, no outer rounds
        outer = OuterLoop(cfg, ctx, model)
        outer.join(step, resumed_outer, redone)  # the newest outer parameters replace the checkpoint's
    segment = logs.start_segment(step)
    metrics = Metrics(
        None if cfg.metrics_port is None else cfg.metrics_port + ctx.rank, rank=ctx.rank, region=ctx.region, host=cfg.metrics_host
    )
    with logs.open_steps() as steps_log, logs.open_keys() if cfg.log_keys else contextlib.nullcontext() as keys_log:
        run = Run(cfg, ctx, model, net, comm, opt, loader, store, outer, metrics, steps_log, keys_log, segment, started_at)
        summary = _loop(run, step)
    if outer is not None:
        outer.leave()
    metrics.close()
    summary = logs.finish(_with_job(summary, cfg, ctx, loader, sync, redone), segment)
    dist.barrier()
    if ctx.rank == 0 and sync != "diloco":  # under DiLoCo regions end apart: the launcher writes the report
        from geoshard.trainer.report import build_report, write_report

        write_report(cfg.out, build_report(cfg.out, cfg.budget))
    return summary


def _make_loader(cfg: TrainConfig, ctx: RankContext) -> RegionalLoader:
    topology = ctx.topology
    if cfg.sync == "diloco":  # each region its own world: the generation is agreed through the outer store
        topology = dataclasses.replace(topology, regions_agree=RegionGenerations.for_job(cfg, ctx.region))
    return make_loader(
        cfg.plan,
        topology=topology,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        collate_fn=ModelInput(cfg.input_field, cfg.label_field) if cfg.model != "none" else count_collate,
        seed=cfg.seed,
        prefetch=cfg.prefetch,
        shuffle_buffer=cfg.shuffle_buffer,
        allow_cross_region=cfg.allow_cross_region,
        follow_refresh=cfg.follow_refresh,
        lease=lease_name(cfg.out),
        timeout=float(cfg.collective_timeout),  # a stuck loader worker ends the rank, as a stuck peer does
    )


def _resume(
    cfg: TrainConfig, ctx: RankContext, model: Net, opt: torch.optim.Optimizer, loader: RegionalLoader, store: CheckpointStore
) -> tuple[int, dict[str, Any] | None]:
    """The step to start from and the checkpoint's outer state (None: no resume)."""
    if not cfg.resume or (latest := store.load_latest()) is None:
        return 0, None
    step, state = latest
    ds = loader.dataset
    check_resumed(cfg, state, store.where, step)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    loader.load_state_dict(loader_position(state["loaders"], ctx.region, ctx.rank))
    log.warning("rank %d: resumed at step %d (epoch %d; %s rank %d)", ctx.rank, step, ds.epoch, ctx.region, ds.rank)
    return step, state.get("outer") or {}


def _with_job(summary: RankSummary, cfg: TrainConfig, ctx: RankContext, loader: RegionalLoader, sync: str, redone: int) -> RankSummary:
    """The loop's summary with where the rank ran and what its region's epochs read."""
    ds = loader.dataset
    remainder = ds.remainder()
    return dataclasses.replace(
        summary,
        backend=ctx.backend,
        device=str(ctx.device),
        world_size=ctx.world_size,
        region=ctx.region,
        region_rank=ds.rank,
        region_size=ds.world_size,
        sync=sync,
        samples_per_epoch=ds.samples_per_epoch * ds.world_size,
        left_out_per_epoch=remainder["dropped_samples"],
        repeated_per_epoch=remainder["padded_samples"],
        region_samples=ds.manifest.samples,
        egress_budget=ds.settings.egress_budget if ds.settings.egress_budget is not None else load_plan(cfg.plan).egress.budget,
        utilization_target=cfg.utilization_target,
        steps_redone=redone,
        generations={str(e): g for e, g in sorted(ds.generations.items())},
    )


def _announce(cfg: TrainConfig, ctx: RankContext, balance: Any, sync: str) -> None:
    """Rank 0 says once where the ranks are and what each epoch leaves out or repeats."""
    if sync == "diloco" and cfg.model == "none":
        print(
            f"geoshard.trainer: {ctx.region}: {ctx.group_size} of the job's {ctx.world_size} rank(s); --model none: "
            "no model, so no outer rounds between the regions (no pseudo-gradients to average)",
            flush=True,
        )
    elif sync == "diloco":
        inner = "DDP in the region" if ctx.group_size > 1 else "one rank in the region, no DDP"
        print(
            f"geoshard.trainer: {ctx.region}: {ctx.group_size} of the job's {ctx.world_size} rank(s); {inner}, "
            f"DiLoCo across {cfg.outer_regions} every {cfg.outer_steps} steps (outer lr {cfg.outer_lr:g}, "
            f"momentum {cfg.outer_momentum:g}{', Nesterov' if cfg.outer_nesterov else ''}, {cfg.outer_compression}"
            f"{'' if cfg.outer_error_feedback or cfg.outer_compression == 'none' else ' without error feedback'}"
            + (f"; peer to peer, sharded over every rank, {cfg.outer_streams} streams" if cfg.outer_transport == "p2p" else "")
            + ")",
            flush=True,
        )
    else:
        print(f"geoshard.trainer: {ctx.world_size} rank(s): {ctx.topology.describe()}; gradient sync {sync}", flush=True)
    if balance is not None:
        print(f"geoshard.trainer: {balance.line()}", flush=True)
        plan = load_plan(cfg.plan)
        for warning in balance.weight_warnings({r: plan.region(r).weight for r in ctx.topology.region_names}):
            log.warning("%s", warning)


@dataclass(frozen=True)
class _Batches:
    """What one step's micro-batches took and gave."""

    wait: float
    compute: float
    loss: float
    samples: int
    keys: list[str]
    handed: float  # when the first one was handed out


def _loop(run: Run, step: int) -> RankSummary:
    cfg, ctx, loader = run.cfg, run.ctx, run.loader
    if len(loader) == 0:
        raise DataError(f"rank {ctx.rank}: this rank's share of region {ctx.region} is empty")
    batches = loader.stream()  # epoch after epoch; the next epoch's workers start before this one ends
    clock = time.perf_counter
    t_loop = clock()
    loop_started_at = time.time()  # the same instant on the wall clock: ranks' steps on one time line
    first_batch: float | None = None
    samples = 0
    start_step = step
    while step < cfg.steps:
        t_step = clock()
        run.opt.zero_grad(set_to_none=True)
        run.comm.step = step
        got = _micro_batches(run, batches)
        if first_batch is None:
            first_batch = got.handed - t_loop
        t2 = clock()
        if cfg.model != "none":
            set_lr(run.opt, cfg, step)
            run.opt.step()
        if cfg.step_time:
            time.sleep(cfg.step_time)  # stated compute: no model, or a larger one than the built-in MLP
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        compute = got.compute + clock() - t2
        step += 1
        samples += got.samples
        if run.keys_log is not None:  # before the checkpoint: a resume after it never redoes this step
            _log_keys(run.keys_log, step, ctx.region, run.loader.dataset, got.keys)
        outer_s, ckpt = _after_step(run, step)
        comm_s, intra_s, cross_s, cross_bytes = run.comm.take()
        record = StepRecord(
            step=step,
            rank=ctx.rank,
            t=clock() - t_loop,
            data_wait_s=got.wait,
            compute_s=compute,
            step_s=clock() - t_step,
            comm_s=comm_s,
            comm_intra_s=intra_s,
            comm_cross_s=cross_s,
            checkpoint_s=ckpt,
            outer_sync_s=outer_s,
            cross_region_grad_bytes=cross_bytes,
            loss=got.loss if cfg.model != "none" else None,
            samples=got.samples,
            region=ctx.region,
            segment=run.segment,
        )
        append_step(run.steps_log, record)
        _observe(run, record)
    return RankSummary(
        rank=ctx.rank,
        wall_s=clock() - t_loop,
        started_at=run.started_at,
        loop_started_at=loop_started_at,
        time_to_first_batch_s=first_batch if first_batch is not None else 0.0,
        steps=step - start_step,
        samples=samples,
        loader=_loader_summary(loader),
        gpu_util=gpu_utilization(),
    )


def _micro_batches(run: Run, batches: Iterator[Any]) -> _Batches:
    """Forward and backward over the step's micro-batches, with the time blocked on each."""
    cfg, clock = run.cfg, time.perf_counter
    wait = compute = loss = 0.0
    keys: list[str] = []
    n = 0
    handed = 0.0
    for micro in range(cfg.accum_steps):
        t0 = clock()
        batch = next(batches)
        t1 = clock()
        wait += t1 - t0
        handed = t1 if micro == 0 else handed
        if cfg.model == "none":  # the data path alone: the batch is consumed, --step-time is the compute
            n += batch["n"]
        else:
            x, y = to_tensors(batch, run.ctx.device)
            loss += forward_backward(run.net, x, y, cfg.accum_steps, last=micro == cfg.accum_steps - 1)
            n += len(y)
        keys += batch["keys"]
        compute += clock() - t1
    return _Batches(wait, compute, loss, n, keys, handed)


def _log_keys(f: TextIO, step: int, region: str, ds: RegionalDataset, keys: list[str]) -> None:
    """One line per step: its keys, and the epoch and generation of its (last) batch."""
    record = {"step": step, "region": region, "epoch": ds.epoch, "generation": ds.manifest.generation, "keys": keys}
    f.write(json.dumps(record) + "\n")
    f.flush()


def _after_step(run: Run, step: int) -> tuple[float, float]:
    """The outer round (DiLoCo) and the checkpoint due after ``step``: their seconds."""
    clock = time.perf_counter
    t_outer = clock()
    if run.outer is not None:  # before the checkpoint, so one taken at a round holds its result
        run.outer.after_step(step)
        if step == run.cfg.steps:
            run.outer.finish()  # a round still in flight (--outer-overlap), in this step's time
    outer_s = clock() - t_outer if run.outer is not None else 0.0
    ckpt = 0.0
    if step % run.cfg.checkpoint_every == 0 or step == run.cfg.steps:
        ckpt = _checkpoint(step, run)
    return outer_s, ckpt


def _observe(run: Run, record: StepRecord) -> None:
    if run.metrics.registry is not None:
        util = gpu_utilization()
        run.metrics.observe_step(record, _loader_summary(run.loader).stats, gpu_util=None if util is None else util / 100)


def _loader_summary(loader: RegionalLoader) -> LoaderSummary:
    return LoaderSummary.from_json(loader.stats(), "the loader's stats")


def _checkpoint(step: int, run: Run) -> float:
    """Rank 0 writes model, optimizer and every rank's loader position; the others wait for it."""
    t0 = time.perf_counter()
    ds = run.loader.dataset
    states: list[Any] = [None] * run.ctx.group_size
    dist.all_gather_object(states, (loader_key(ds.region, ds.rank), run.loader.state_dict()))
    outer = None if run.outer is None else run.outer.state()  # collective: p2p ranks hold shards of it
    if run.ctx.group_rank == 0:
        state = {
            "step": step,
            "model": run.model.state_dict(),
            "optimizer": run.opt.state_dict(),
            "inner_optimizer": run.cfg.inner_optimizer,
            "loaders": dict(states),
        }
        if outer is not None:
            state["outer"] = outer
        run.store.save(step, state)
    dist.barrier()
    return time.perf_counter() - t0
