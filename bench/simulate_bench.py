"""``geoshard simulate`` against real runs under the WAN rehearsal (issue 21, part 3). Needs root.

The setup of bench/wan_bench.py ``train``: the multi-region split (24,000 samples of 1,000 bytes,
weights 2:1:1), one SeaweedFS on the host with a bucket per region, each bucket served at its
region's address (``Rehearsal.expose``), every packet between regions behind ``--matrix``
(bench/wan-matrix.toml: 38 / 110 / 85 ms one way, 200 / 100 / 100 Mbit/s). Each configuration is
trained with ``launch_regions`` inside the namespaces (what ``geoshard train --regions --wan``
does) and predicted with ``geoshard simulate --json --rehearsal`` from the same options.

Two sets, never mixed: ``CALIBRATION`` (C1-C10; C7-C8 and C10 on the p2p transport, C9-C10 on
local replicas) fits the model's few constants (the built-in model's CPU rate and per-step
overhead, the loader's start-up with and without an S3 client, the comm hook's cost per bucket,
the per-message overhead of gloo's ring steps and hierarchical's extra, the store's per-request
and per-byte cost, the first DiLoCo round's start-up skew, the p2p round's per-value passes,
gather and residual from its round records' phases); each run samples the host's load through
itself for the host slowdown; ``VALIDATION`` (27 configurations: flat / hierarchical / DiLoCo on
the store and on p2p, H, overlap, accumulation, fp16, its own bucket, another region's or a local
replica, 1-3 ranks per region) is predicted with those constants and the forwarder ceiling this
rehearsal measured at its start, and compared per
metric: median absolute relative error and the worst configuration.

    sudo .venv/bin/python bench/simulate_bench.py                    # ~30-40 minutes on 2 busy cores
    sudo .venv/bin/python bench/simulate_bench.py --only V1,V13      # some validation runs (calibration first)
    sudo .venv/bin/python bench/simulate_bench.py --small            # smoke run: 2+2 runs, 8 steps
    sudo .venv/bin/python bench/simulate_bench.py --probes P1,P2,P3,P4,P5 --json-out bench/_data/probes.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the test suite uses
sys.path.insert(0, str(ROOT / "bench"))
GEOSHARD = str(Path(sys.executable).with_name("geoshard"))

ONE = "us-east-1:1,eu-west-1:1,ap-southeast-1:1"
TWO = "us-east-1:2,eu-west-1:1,ap-southeast-1:1"
THREE = "us-east-1:3,eu-west-1:1,ap-southeast-1:1"


@dataclass(frozen=True)
class Spec:
    name: str
    sync: str
    ranks: str = ONE
    hidden: int = 512
    accum: int = 1
    fp16: bool = False
    remote: bool = False
    outer_steps: int = 10
    overlap: int = 0
    outer_compression: str = "fp16"
    # C1-C6 and V1-V20 (12-04) ran the store transport; p2p became geoshard train's default after
    # them, and C7-C8 / V21-V25 run it (rows without the key are store runs)
    outer_transport: str = "store"
    # Each region on its local replica (the split's folder), no bucket in the plan: the loader's
    # start-up without an S3 client in its workers (C9; rows without the key read their buckets)
    replica: bool = False


CALIBRATION = (
    Spec("C1", "flat", hidden=256),
    Spec("C2", "hierarchical", ranks=TWO, hidden=1024),
    Spec("C3", "flat", hidden=1024, accum=2, fp16=True),
    Spec("C4", "diloco", hidden=768, outer_steps=8),
    Spec("C5", "hierarchical", remote=True, hidden=256),
    # DiLoCo with a two-rank region: the only DDP without a WAN hop (bucket_s; a one-rank region runs
    # no DDP); a pseudo-gradient 1.6x C4's, so the store's per-byte and per-request costs separate
    Spec("C6", "diloco", ranks=TWO, hidden=1024, outer_steps=6),
    # The peer-to-peer transport (train's default): two pseudo-gradient sizes, so its per-byte host
    # passes (prepare, MAC, step, gather) separate from its fixed trips; C8 has a two-rank region
    # (shards over two owners there, the in-region gather)
    Spec("C7", "diloco", hidden=768, outer_steps=8, outer_transport="p2p"),
    Spec("C8", "diloco", ranks=TWO, hidden=1024, outer_steps=6, outer_transport="p2p"),
    # Local replicas: the start-up without an S3 client (startup_s; the buckets' runs give s3_startup_s)
    Spec("C9", "flat", hidden=512, replica=True),
    Spec("C10", "diloco", hidden=512, outer_steps=8, outer_transport="p2p", replica=True),
)

VALIDATION = (
    Spec("V1", "flat", hidden=768),
    Spec("V2", "flat", accum=2),
    Spec("V3", "flat", accum=4),
    Spec("V4", "flat", fp16=True),
    Spec("V5", "flat", ranks=TWO),
    Spec("V6", "flat", remote=True),
    Spec("V7", "flat", hidden=1024),
    Spec("V8", "hierarchical"),
    Spec("V9", "hierarchical", ranks=TWO, accum=2),
    Spec("V10", "hierarchical", ranks=TWO, hidden=768, fp16=True),
    Spec("V11", "hierarchical", ranks=TWO, remote=True),
    Spec("V12", "hierarchical", ranks=THREE),
    Spec("V13", "hierarchical", hidden=1024, accum=4),
    Spec("V14", "diloco", outer_steps=5),
    Spec("V15", "diloco", outer_steps=10, overlap=5),
    Spec("V16", "diloco", hidden=1024, outer_steps=20),
    Spec("V17", "diloco", hidden=1024, outer_steps=20, overlap=10),
    Spec("V18", "diloco", ranks=TWO, outer_steps=10),
    Spec("V19", "diloco", outer_steps=10, outer_compression="none"),
    Spec("V20", "diloco", outer_steps=10, remote=True),
    Spec("V21", "diloco", outer_steps=5, outer_transport="p2p"),
    Spec("V22", "diloco", outer_steps=10, overlap=5, outer_transport="p2p"),
    Spec("V23", "diloco", hidden=1024, outer_steps=20, overlap=10, outer_transport="p2p"),
    Spec("V24", "diloco", ranks=TWO, hidden=768, outer_steps=10, outer_transport="p2p"),
    Spec("V25", "diloco", outer_steps=10, remote=True, outer_transport="p2p"),
    Spec("V26", "hierarchical", ranks=TWO, replica=True),
    Spec("V27", "diloco", outer_steps=10, outer_transport="p2p", replica=True),
)

# Not validation: DiLoCo runs reading another region's bucket (V20's) at three pseudo-gradient
# sizes and one reading its own, to see whether the outer round's bytes on the link the shards
# come over are what makes their IO wait (run with --probes; never fitted or compared)
PROBES = (
    Spec("P1", "diloco", hidden=64, outer_steps=10, remote=True),
    Spec("P2", "diloco", hidden=512, outer_steps=10, remote=True),
    Spec("P3", "diloco", hidden=1024, outer_steps=10, remote=True),
    Spec("P4", "diloco", hidden=1024, outer_steps=10),
    Spec("P5", "flat", remote=True),  # V6: a flat run reading remote, whose steps are longer
    # the store's first round at two model sizes (issue 21: its excess grows with the model)
    Spec("P6", "diloco", hidden=512, outer_steps=6),
    Spec("P7", "diloco", ranks=TWO, hidden=1024, outer_steps=6),  # C6's configuration
)

# report.json's figures compared; shares and seconds are relative errors of the figure itself.
METRICS = (
    "utilization",
    "step_s",
    "grad_sync_s_per_step",
    "cross_region_grad_bytes_per_step",
    "time_to_first_batch_s",
    "io_wait_share_after_first_batch",
    "outer_sync_s_mean",
    "wan_bytes",
)


def figures(rep: dict[str, Any]) -> dict[str, float | None]:
    """The compared figures of a report.json (a run's or a prediction's)."""
    outer = rep.get("outer") or {}
    step = rep.get("step_s")
    if step is None:  # a run: the loop's wall per rank and step, after the first batch
        step = (rep["breakdown"]["wall"]["seconds"] / rep["world_size"] - (rep["time_to_first_batch_s"] or 0)) / rep["steps"]
    return {
        "utilization": rep["utilization"]["share"],
        "step_s": step,
        "grad_sync_s_per_step": rep["grad_sync_s_per_step"],
        "cross_region_grad_bytes_per_step": rep["cross_region_grad_bytes_per_step"],
        "time_to_first_batch_s": rep["time_to_first_batch_s"],
        "io_wait_share_after_first_batch": rep["io_wait_share_after_first_batch"],
        "outer_sync_s_mean": outer.get("sync_s_mean"),
    }


def train_argv(spec: Spec, plan: Path, args: argparse.Namespace) -> list[str]:
    """The options shared by the run and its prediction (geoshard train's)."""
    argv = ["--plan", str(plan), "--regions", spec.ranks, "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    argv += ["--hidden", str(spec.hidden), "--accum-steps", str(spec.accum), "--num-workers", "1", "--sync", spec.sync]
    argv += ["--step-time", str(args.step_time), "--checkpoint-every", str(args.steps), "--backend", "gloo"]
    if spec.fp16:
        argv += ["--grad-compression", "fp16"]
    if spec.sync == "diloco":
        argv += ["--outer-steps", str(spec.outer_steps), "--outer-overlap", str(spec.overlap)]
        argv += ["--outer-compression", spec.outer_compression, "--outer-timeout", "300", "--outer-transport", spec.outer_transport]
    return argv


SHARDS = '[shards]\nbytes = "8MB"\n'  # the shard size multiregion_bench's split was made with


def bucket_plan(path: Path, endpoints: dict[str, str]) -> Path:
    """multiregion_bench's plan with the shard size its split was made with (sync refuses another)."""
    from multiregion_bench import bucket_plan as regions_plan

    regions_plan(path, endpoints)
    path.write_text(SHARDS + path.read_text())
    return path


def replica_plan(path: Path, split: Path) -> Path:
    """Every region on its local replica: the split's own folder for it, no bucket."""
    from multiregion_bench import WEIGHTS

    regions = "".join(f'[regions.{r}]\nweight = {w}\nlocal = "{split / r}"\n' for r, w in WEIGHTS.items())
    path.write_text(SHARDS + regions)
    return path


def sync(split: Path, server: Any, env: dict[str, str], work: Path) -> None:
    from multiregion_bench import WEIGHTS

    plan = bucket_plan(work / "sync-plan.toml", dict.fromkeys(WEIGHTS, server.endpoint))
    argv = [GEOSHARD, "sync", str(split), "--plan", str(plan), "--create-buckets"]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=600)
    if r.returncode:
        raise RuntimeError(f"sync failed: {r.stderr[-2000:]}")


def run_one(spec: Spec, wan: Any, net: Any, endpoints: dict[str, str], env: dict[str, str], work: Path, args: argparse.Namespace) -> dict:
    from multiregion_bench import READS_FROM, WEIGHTS

    from geoshard.trainer.config import TrainConfig, parse_regions
    from geoshard.trainer.launch import launch_regions
    from geoshard.trainer.report import build_report

    reads = {r: READS_FROM[r] if spec.remote else r for r in WEIGHTS}
    if spec.replica:
        plan = replica_plan(args.json_out.with_suffix(".plan-replica.toml"), args.split)
    else:
        plan = bucket_plan(
            args.json_out.with_suffix(f".plan-{'remote' if spec.remote else 'local'}.toml"), {r: endpoints[reads[r]] for r in WEIGHTS}
        )
    out = work / f"run-{spec.name}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(
        plan=plan,
        out=out,
        steps=args.steps,
        batch_size=args.batch_size,
        accum_steps=spec.accum,
        hidden=spec.hidden,
        num_workers=1,
        grad_compression="fp16" if spec.fp16 else "none",
        sync=spec.sync,
        outer_steps=spec.outer_steps,
        outer_overlap=spec.overlap,
        outer_compression=spec.outer_compression,
        outer_transport=spec.outer_transport,
        outer_timeout=300.0,
        step_time=args.step_time,
        backend="gloo",
        checkpoint_every=args.steps,
        allow_cross_region=False,
    )
    before = wan.counters()
    t0 = time.monotonic()
    with LoadSampler() as sampled:
        code = launch_regions(cfg, parse_regions(spec.ranks), env=env, net=net)
    seconds = time.monotonic() - t0
    if code != 0:
        raise RuntimeError(f"run {spec.name} failed ({code}); logs in {out}/logs")
    crossed = {f"{a}>{b}": v[0] - before[(a, b)][0] for (a, b), v in wan.counters().items()}
    rep = build_report(out, cfg.budget)
    measured = {**figures(rep), "wan_bytes": sum(crossed.values())}
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    load = round(os.getloadavg()[0], 1)  # the 1-minute load as the run ends: the host slowdown it ran at
    # Each round's wait (the slowest region's), not compared: the first one also waits for the
    # regions' start-up skew, which a model of it would be fitted from.
    rounds = [r["sync_s"] for r in (rep.get("outer") or {}).get("rounds", [])]
    row = {"phases": round_phases(out)} if spec.sync == "diloco" else {}
    row |= {"spec": spec.__dict__, "seconds": round(seconds, 1), "measured": measured, "pairs": crossed, "plan": str(plan), "load": load}
    row["waits"] = step_waits(out)
    row["starts"] = rank_starts(out)
    row["arrivals"] = round_arrivals(out)
    row["load_during"] = sampled.summary()
    return {**row, "outer_rounds_s": rounds}


def step_waits(out: Path, above_s: float = 0.01) -> dict[str, list[list[float]]]:
    """Per rank, the steps after the first whose data wait exceeded ``above_s``: where the IO wait
    after the first batch falls (one stall early in the run, or a little every step)."""
    waits = {}
    for f in sorted(out.glob("steps-rank*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        late = [r for r in recs if r["step"] > 1 and r["data_wait_s"] > above_s]
        waits[f.stem.removeprefix("steps-")] = [[r["step"], round(r["data_wait_s"], 3)] for r in late]
    return waits


def _ranks_on_one_line(out: Path) -> tuple[dict[str, dict[str, Any]], float | None]:
    """The ranks' summaries (rank*.json) that have a loop start, and the earliest loop start."""
    ranks = {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))}
    ranks = {name: r for name, r in ranks.items() if r.get("loop_started_at")}
    return ranks, min((r["loop_started_at"] for r in ranks.values()), default=None)


def rank_starts(out: Path) -> dict[str, dict[str, float]]:
    """Per rank, its start-up on one time line: the process start and the loop's start, as
    seconds after the earliest loop start, and its time to the first batch. Says whether the
    ranks' loaders started together (crowding the host's cores) or one after another."""
    ranks, t0 = _ranks_on_one_line(out)
    if t0 is None:
        return {}
    return {
        name: {
            "process_s": round(r["started_at"] - t0, 3) if r.get("started_at") else None,
            "loop_s": round(r["loop_started_at"] - t0, 3),
            "first_batch_s": round(r["time_to_first_batch_s"], 3),
        }
        for name, r in ranks.items()
    }


def round_arrivals(out: Path) -> dict[str, list[float]]:
    """Per rank, when it reached each outer round (the step records with an outer wait: the step's
    end less that wait), as seconds after the earliest loop start: how far apart the regions
    arrive at the first round, and whether their steps before it ran at one speed."""
    ranks, t0 = _ranks_on_one_line(out)
    if t0 is None:
        return {}
    arrivals = {}
    for name, r in ranks.items():
        f = out / f"steps-{name}.jsonl"
        if not f.exists():
            continue
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        at = [r["loop_started_at"] - t0 + x["t"] - x["outer_sync_s"] for x in recs if x.get("outer_sync_s")]
        arrivals[name] = [round(a, 3) for a in at]
    return arrivals


def round_phases(out: Path) -> list[dict[str, Any]]:
    """Every region leader's round records: what each round's exchange took (p2p: where it went, ``phases``)."""
    from geoshard.trainer.diloco.record import read_rounds

    return [
        {"region": r.region, "round": r.round, "exchange_s": round(r.exchange_s, 4), "sync_s": round(r.sync_s, 4), "phases": dict(r.phases)}
        for r in read_rounds(out)
        if r.event == "round"
    ]


class LoadSampler:
    """The host's load sampled through a run (every second, on a thread): the 1-minute load
    average and the kernel's count of runnable threads (/proc/stat ``procs_running``, an
    instantaneous run queue that the 1-minute average smooths over a minute)."""

    def __init__(self, every_s: float = 1.0) -> None:
        import threading

        self.every_s, self.loads, self.running = every_s, [], []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.loads.append(os.getloadavg()[0])
            try:
                stat = Path("/proc/stat").read_text().splitlines()
                self.running.append(next(int(x.split()[1]) for x in stat if x.startswith("procs_running")))
            except (OSError, StopIteration, ValueError):  # not Linux: the load average alone
                pass

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def summary(self) -> dict[str, Any]:
        def mean(xs: list[float]) -> float | None:
            return round(statistics.fmean(xs), 2) if xs else None

        return {"samples": len(self.loads), "load_mean": mean(self.loads), "running_mean": mean(self.running),
                "load_max": round(max(self.loads), 2) if self.loads else None}  # fmt: skip


def predict_one(row: dict[str, Any], constants: Path, args: argparse.Namespace) -> dict[str, float | None]:
    """``geoshard simulate --json`` for the run's options, with the fitted constants."""
    from multiregion_bench import READS_FROM

    spec = Spec(**row["spec"])
    argv = [GEOSHARD, "simulate", *train_argv(spec, Path(row["plan"]), args), "--wan", str(args.matrix), "--rehearsal"]
    argv += ["--constants", str(constants), "--samples", str(args.samples), "--sample-bytes", str(sim_sample_bytes(args))]
    argv += ["--shard-bytes", str(args.shard_bytes), "--host-slowdown", str(slowdown(row)), "--json"]
    if spec.remote:
        argv += ["--data-from", ",".join(f"{a}={b}" for a, b in READS_FROM.items())]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if r.returncode:
        raise RuntimeError(f"simulate failed for {spec.name}: {r.stderr.strip()}")
    rep = json.loads(r.stdout)
    out = {**figures(rep), "wan_bytes": sum(e["bytes"] for e in rep["egress"])}
    if (rep.get("outer") or {}).get("phases"):
        out["phases"] = rep["outer"]["phases"]  # one round's, to set beside the records' (not a compared metric)
    return out


def sim_sample_bytes(args: argparse.Namespace) -> int:
    """The sample size the predictions are given: as stored (a shard's bytes over its samples, the
    tar headers and every file of the sample included: what the loader fetches), or with
    ``--sample-bytes-as payload`` the synthetic payload alone (what runs before 12-07 were given)."""
    if getattr(args, "sample_bytes_as", "stored") == "payload":
        return int(args.sample_bytes)
    return round(args.shard_bytes / args.shard_samples)


def slowdown(row: dict[str, Any]) -> float:
    """The host's slowdown during a run: its 1-minute load over this machine's 2 cores, at least 1.
    The load is the mean of the samples taken through the run (``LoadSampler``); rows from before
    the sampler have only the load at the run's end."""
    during = (row.get("load_during") or {}).get("load_mean")
    return max(1.0, (during if during is not None else row["load"]) / 2)


def fit(rows: list[dict[str, Any]], base: Any, args: argparse.Namespace) -> Any:
    """The constants from the calibration runs alone, each from the figure it alone decides, per
    unit of host slowdown (each row's residual over its load / cores)."""
    from geoshard.sim import grad, predict
    from geoshard.sim.config import Constants
    from geoshard.sim.loader import startup_s as loader_startup_s
    from geoshard.sim.outer import store_round
    from geoshard.sim.predict import compute_s

    k: Constants = base

    def at(row: dict[str, Any], kk: Constants) -> Any:  # the row's config, host costs at its load
        cfg = sim_config_of(row, kk, args)
        return replace(cfg, constants=replace(kk, host_slowdown=slowdown(row)).on_host())

    # Compute per optimizer step (the report's compute without exchange, less the stated step
    # time) = overhead + flops of its micro-batches / rate: least squares. The overhead is per
    # step, not per micro-batch: with it per micro-batch the accumulation runs (C3, V2, V3, V9)
    # were predicted 1.3-1.9x their utilization (validation median 17.0%; per step 12.7%).
    xs, ys = [], []
    for row in rows:
        s, m = Spec(**row["spec"]), row["measured"]
        params = s.hidden**2 + 268 * s.hidden + 10
        per_step = m["utilization"] * (m["step_s"] * args.steps + (m["time_to_first_batch_s"] or 0)) / args.steps
        xs.append(6 * params * args.batch_size * s.accum / slowdown(row))
        ys.append((per_step - args.step_time) / slowdown(row))
    slope, intercept = _line(xs, ys)
    if slope > 1e-12:  # a rate below 1,000 GFLOPS: the model's size shows in its compute
        k = replace(k, cpu_gflops=round(1 / slope / 1e9, 3), step_overhead_s=round(max(intercept, 0.0), 5))
    else:  # it does not (a loaded machine: the compute is waiting for a core): the median overhead alone
        k = replace(k, cpu_gflops=1e6, step_overhead_s=round(max(0.0, statistics.median(ys)), 5))

    # The loader's start-up: what the first batch takes beyond the manifest and the first shard, as
    # a rank starting alone takes it (a run's residual over its crowding, sim/loader.py startup_s).
    # startup_s from the runs on local replicas; s3_startup_s what the runs reading a bucket take
    # beyond it (their workers' own S3 clients). Runs of before 12-07 have no replica run: startup_s alone.
    def start_alone(row: dict[str, Any]) -> float:
        p = predict(at(row, replace(k, startup_s=0.0, s3_startup_s=0.0)))
        cfg = at(row, k)
        unit = replace(cfg, constants=replace(cfg.constants, startup_s=1.0, s3_startup_s=0.0))
        crowd = max(loader_startup_s(unit, r) for r in cfg.regions)
        return (row["measured"]["time_to_first_batch_s"] - p.time_to_first_batch_s) / slowdown(row) / crowd

    replica = [start_alone(row) for row in rows if row["spec"].get("replica")]
    bucket = [start_alone(row) for row in rows if not row["spec"].get("replica")]
    base = statistics.median(replica) if replica else statistics.median(bucket)
    extra = statistics.median(bucket) - base if replica and bucket else 0.0
    k = replace(k, startup_s=round(max(0.0, base), 4), s3_startup_s=round(max(0.0, extra), 4))
    # The hand-off of a batch from a worker when the workers keep up: the IO wait after the first batch.
    m = [r["measured"] for r in rows]
    waits = [x["io_wait_share_after_first_batch"] * x["step_s"] / r["spec"]["accum"] / slowdown(r) for x, r in zip(m, rows, strict=True)]
    k = replace(k, batch_s=round(statistics.median(waits), 5))
    # The comm hook's own time per bucket: DiLoCo's sync in a two-rank region crosses no WAN (a
    # one-rank region runs no DDP, trainer/comm.py for_sync): the residual over the ring's bytes at
    # the region's own rate, per bucket and per rank share that runs it (report.json's mean is over all ranks).
    alone = []
    for row in rows:
        cfg = at(row, replace(k, bucket_s=0.0))
        peers = sum(r.ranks for r in cfg.regions if r.ranks > 1)
        if cfg.sync == "diloco" and peers and cfg.params:
            n = len(grad.buckets(tuple(4 * t for t in cfg.tensor_params)))
            rest = row["measured"]["grad_sync_s_per_step"] - grad.step_exchange(cfg).seconds
            alone.append(rest * cfg.world_size / peers / n / slowdown(row))
    k = replace(k, bucket_s=round(max(0.0, statistics.median(alone)), 5) if alone else k.bucket_s)
    # gloo's per-message overhead: the sync's residual over its message count (2(n-1) per bucket),
    # from the flat runs (gloo's threads alone), then hierarchical's extra per message (its hook on the training thread).
    for sync, name in (("flat", "trip_s"), ("hierarchical", "hook_trip_s")):
        trips = []
        for row in rows:
            cfg = at(row, replace(k, **{name: 0.0}))
            if cfg.sync != sync or row["measured"]["grad_sync_s_per_step"] <= 0:
                continue
            n = cfg.world_size if cfg.sync == "flat" else len(cfg.regions)
            buckets = len(grad.buckets(tuple(4 * t for t in cfg.tensor_params)))
            count = 2 * (n - 1) * (-(-buckets // k.gloo_threads) if cfg.sync == "flat" else buckets)
            exchange = grad.mean_exchange(cfg, idle_s=compute_s(cfg)).seconds
            trips.append((row["measured"]["grad_sync_s_per_step"] - exchange) / count / slowdown(row))
        k = replace(k, **{name: round(max(0.0, statistics.median(trips)), 5) if trips else getattr(k, name)})
    # The store's costs: a round's residual over its requests and its bytes (least squares over
    # the median of the rounds after the first: the first also waits for the regions' start-up skew; rows
    # without the rounds: their mean). Neither is a host cost (config.HOST_COSTS): not scaled.
    req, nbytes, rest, firsts = [], [], [], []
    for row in rows:
        cfg = at(row, replace(k, store_request_s=0.0, store_byte_s=0.0))
        rounds = row.get("outer_rounds_s") or []
        if cfg.sync != "diloco" or cfg.outer_transport != "store" or not row["measured"]["outer_sync_s_mean"] or cfg.outer_overlap:
            continue
        # the median: C6's second round (11.1 s against 3-4 s after it) also waited for a late start
        later = statistics.median(rounds[1:]) if len(rounds) > 1 else row["measured"]["outer_sync_s_mean"]
        base = store_round(cfg)
        req.append(k.outer_trips_before + k.outer_trips_after)
        nbytes.append(base.bytes)
        rest.append(later - base.seconds)
        if len(rounds) > 1:
            firsts.append((row, rounds[0] - later))
    per_req, per_byte = _store_costs(req, nbytes, rest)
    k = replace(k, store_request_s=round(per_req, 4), store_byte_s=float(f"{per_byte:.4g}"))
    # The launch's stagger: the first round's excess over the later ones, less the spread of the
    # regions' predicted first batches (which the model adds on its own).
    skews = []
    for row, excess in firsts:
        regions = predict(at(row, k)).regions
        skews.append(excess - (max(x.time_to_first_batch_s for x in regions) - min(x.time_to_first_batch_s for x in regions)))
    k = replace(k, startup_skew_s=round(max(0.0, statistics.median(skews)), 4) if skews else k.startup_skew_s)
    return fit_p2p(rows, k, at)


# The p2p round's phases (trainer/diloco/p2p.py) and the constant each one gives (sim/p2p.py).
PER_VALUE = {
    "prepare": "p2p_prepare_value_s",
    "mac_publish": "p2p_mac_value_s",
    "mac_check": "p2p_check_value_s",
    "step": "p2p_step_value_s",
}


def fit_p2p(rows: list[dict[str, Any]], k: Any, at: Any) -> Any:
    """The p2p round's constants from the calibration runs' round records (``phases``), per unit
    of host slowdown (all of them are the host's): each pass's seconds a value (the median over
    every region's rounds, over the values the region's leader owns), the gather's over the whole vector in regions of 2+ ranks,
    the groups from the rounds that made them; then ``p2p_fixed_s``, what the slowest region waits
    beyond the model's terms (the regions' arrival skew, the region's agreement: the median of the
    rounds after the first), and the start-up skew as the store's (the first round's excess)."""
    from geoshard.sim import predict
    from geoshard.sim.p2p import p2p_round

    recs, groups = [], []  # (row, ranks in the record's region, record) of every region's rounds
    for row in rows:
        cfg = at(row, k)
        if cfg.sync != "diloco" or cfg.outer_transport != "p2p" or not row.get("phases"):
            continue
        for rec in row["phases"]:
            if rec["phases"].get("groups", 0.0) > 0.2:  # the rounds that made the shards' groups
                groups.append(rec["phases"]["groups"] / slowdown(row))
            recs.append((row, cfg, {g.name: g.ranks for g in cfg.regions}[rec["region"]], rec))
    if not recs:
        return k
    values: dict[str, Any] = {}
    for phase, name in PER_VALUE.items():
        xs = [cfg.params / n for _, cfg, n, _ in recs]  # the values the region's leader owns
        ys = [rec["phases"].get(phase, 0.0) / slowdown(row) for row, _, _, rec in recs]
        # the median seconds a value, not a least-squares slope: a few rounds where a pass waited
        # for a core (C8's mac_check 0.55-0.78 s against a median of 0.15 s) would set the slope
        values[name] = float(f"{max(0.0, statistics.median(y / x for x, y in zip(xs, ys, strict=True))):.4g}")
    gathered = [rec["phases"].get("gather", 0.0) / slowdown(row) / cfg.params for row, cfg, n, rec in recs if n > 1]
    values["p2p_gather_value_s"] = float(f"{statistics.median(gathered):.4g}") if gathered else k.p2p_gather_value_s
    values["p2p_groups_s"] = round(statistics.median(groups), 4) if groups else 0.0
    k = replace(k, **values, p2p_fixed_s=0.0)
    rest, skews = [], []
    for row in rows:
        cfg = at(row, k)
        rounds = row.get("outer_rounds_s") or []
        if cfg.outer_transport != "p2p" or cfg.sync != "diloco" or cfg.outer_overlap or len(rounds) < 2:
            continue
        later = statistics.median(rounds[1:])
        rest.append((later - p2p_round(cfg).seconds) / slowdown(row))
        regions = predict(cfg).regions
        spread = max(x.time_to_first_batch_s for x in regions) - min(x.time_to_first_batch_s for x in regions)
        skews.append(rounds[0] - later - spread - k.p2p_groups_s * slowdown(row))
    k = replace(k, p2p_fixed_s=round(max(0.0, statistics.median(rest)), 4) if rest else 0.0)
    return replace(k, p2p_startup_skew_s=round(max(0.0, statistics.median(skews)), 4) if skews else k.p2p_startup_skew_s)


def _store_costs(requests: list[int], nbytes: list[float], rest: list[float]) -> tuple[float, float]:
    """rest = a·requests + b·bytes by least squares (a, b >= 0); one size alone: b = 0, a its median."""
    if len(set(nbytes)) < 2:
        return (max(0.0, statistics.median(r / n for r, n in zip(rest, requests, strict=True))) if rest else 0.0), 0.0
    xs = [b / n for b, n in zip(nbytes, requests, strict=True)]  # per request: rest/requests = a + b·(bytes/requests)
    ys = [r / n for r, n in zip(rest, requests, strict=True)]
    slope, intercept = _line(xs, ys)
    if slope < 0:
        return max(0.0, statistics.fmean(ys)), 0.0
    if intercept < 0:
        return 0.0, sum(y * x for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return intercept, slope


def sim_config_of(row: dict[str, Any], k: Any, args: argparse.Namespace) -> Any:
    """The SimConfig ``geoshard simulate`` builds for a row, in process (for the fit)."""

    from geoshard.cli.simulate import sim_config

    spec = Spec(**row["spec"])
    kw = _cli_kwargs(spec, Path(row["plan"]), args)
    cfg = sim_config(kw)
    return replace(cfg, constants=k)


def _cli_kwargs(spec: Spec, plan: Path, args: argparse.Namespace) -> dict[str, Any]:
    from multiregion_bench import READS_FROM

    from geoshard.cli.simulate import simulate

    argv = [*train_argv(spec, plan, args), "--wan", str(args.matrix), "--rehearsal", "--samples", str(args.samples)]
    argv += ["--sample-bytes", str(sim_sample_bytes(args)), "--shard-bytes", str(args.shard_bytes)]
    if spec.remote:
        argv += ["--data-from", ",".join(f"{a}={b}" for a, b in READS_FROM.items())]
    ctx = simulate.make_context("simulate", argv)
    return dict(ctx.params)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return slope, my - slope * mx


# Absolute floors under the error's denominator (tests/test_plan_optimize.py's ``_errors``): a
# share of 0.1% or a sync of 10 ms measured is at the noise of one run here, and an error relative
# to it says nothing. Shown beside the plain relative error, never instead of it.
FLOOR = {
    "utilization": 0.01,
    "io_wait_share_after_first_batch": 0.01,
    "step_s": 0.05,
    "grad_sync_s_per_step": 0.05,
    "time_to_first_batch_s": 0.05,
    "outer_sync_s_mean": 0.05,
}


def errors(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric: the median absolute relative error over the runs that have it (and with the
    metric's floor under the denominator), and the worst run by relative error."""
    table: dict[str, dict[str, Any]] = {}
    for metric in METRICS:
        errs, floored = [], []
        for row in rows:
            m, p = row["measured"].get(metric), row["predicted"].get(metric)
            if m is None or p is None or m == 0:
                continue
            errs.append((abs(p - m) / abs(m), row["spec"]["name"], m, p))
            floored.append(abs(p - m) / max(abs(m), FLOOR.get(metric, 0.0)))
        if errs:
            worst = max(errs)
            table[metric] = {
                "runs": len(errs),
                "median": round(statistics.median(e[0] for e in errs), 4),
                "median_floored": round(statistics.median(floored), 4),
                "floor": FLOOR.get(metric),
                "worst": {"run": worst[1], "error": round(worst[0], 4), "measured": worst[2], "predicted": worst[3]},
            }
    return table


def markdown(res: dict[str, Any], key: str = "errors") -> str:
    lines = ["| metric | runs | median abs. error | with floor | worst run | its error (measured -> predicted) |"]
    lines.append("|---|---|---|---|---|---|")
    for metric, e in res[key].items():
        w = e["worst"]
        its = f"{w['error']:.1%} ({w['measured']:.4g} -> {w['predicted']:.4g})"
        floor = f"{e['median_floored']:.1%} (floor {e['floor']:g})" if e.get("floor") else "-"
        lines.append(f"| {metric} | {e['runs']} | {e['median']:.1%} | {floor} | {w['run']} | {its} |")
    return "\n".join(lines)


def scale(args: argparse.Namespace) -> int:
    """The simulator's own time at three sizes: ``geoshard simulate --json`` end to end (a fresh
    process) and ``predict`` alone, for flat, hierarchical and DiLoCo."""
    from geoshard.sim import predict
    from geoshard.sim.config import SimConfig

    sizes = ((3, 4, 10**6), (16, 128, 10**8), (64, 1000, 10**9))  # regions, ranks, samples
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for regions, ranks, samples in sizes:
            names = [f"r{i:02d}-sim-1" for i in range(regions)]
            plan, matrix = Path(tmp) / f"plan-{regions}.toml", Path(tmp) / f"wan-{regions}.toml"
            plan.write_text("".join(f'[regions.{n}]\nweight = 1\nbucket = "s3://b-{n}/t"\n' for n in names))
            links = [(a, b, 20 + (i * 7 + j * 3) % 150) for i, a in enumerate(names) for j, b in enumerate(names) if i < j]
            matrix.write_text("".join(f'[[link]]\na = "{a}"\nb = "{b}"\nlatency_ms = {ms}\nbandwidth_mbit = 10000\n' for a, b, ms in links))
            per = [ranks // regions + (1 if i < ranks % regions else 0) for i in range(regions)]
            spec = ",".join(f"{n}:{k}" for n, k in zip(names, per, strict=True))
            for sync in ("flat", "hierarchical", "diloco"):
                argv = [GEOSHARD, "simulate", "--plan", str(plan), "--regions", spec, "--wan", str(matrix), "--steps", "1000000"]
                argv += ["--sync", sync, "--outer-steps", "500", "--params", str(10**10), "--samples", str(samples), "--json"]
                t0 = time.perf_counter()
                r = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
                cli_s = time.perf_counter() - t0
                if r.returncode:
                    raise RuntimeError(r.stderr)
                from geoshard.cli.simulate import sim_config, simulate

                cfg: SimConfig = sim_config(dict(simulate.make_context("simulate", argv[2:]).params))
                t0 = time.perf_counter()
                predict(cfg)
                rows.append(
                    {"regions": regions, "ranks": ranks, "samples": samples, "sync": sync, "cli_s": round(cli_s, 3),
                     "predict_s": round(time.perf_counter() - t0, 4), "load": round(os.getloadavg()[0], 1)}
                )  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    print("| regions | ranks | samples | sync | geoshard simulate (process) | predict() | load |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        cells = [str(x["regions"]), f"{x['ranks']:,}", f"{x['samples']:.0e}", x["sync"], f"{x['cli_s']:.2f} s"]
        print("| " + " | ".join([*cells, f"{x['predict_s'] * 1000:.1f} ms", str(x["load"])]) + " |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", type=Path, default=ROOT / "bench" / "wan-matrix.toml")
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / "_data" / "multiregion")
    ap.add_argument("--samples", type=int, default=24_000)
    ap.add_argument("--sample-bytes", type=int, default=1000)
    ap.add_argument("--shard-samples", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--step-time", type=float, default=0.1)
    ap.add_argument("--only", help="validation runs to do, e.g. V1,V14 (the calibration set always runs)")
    ap.add_argument("--small", action="store_true", help="smoke run: two calibration and two validation runs of 8 steps")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "simulate_bench.json")
    ap.add_argument("--scale", action="store_true", help="no runs: the simulator's own time at three sizes")
    ap.add_argument("--resume", action="store_true", help="keep --json-out's runs and do only the others")
    ap.add_argument(
        "--sample-bytes-as",
        choices=("stored", "payload"),
        default="stored",
        help="the sample size predictions get: as stored in the shards (default) or the payload alone (before 12-07)",
    )
    ap.add_argument("--refit", action="store_true", help="no runs: fit and predict again from --json-out's measurements")
    ap.add_argument("--probes", help="only these of PROBES, e.g. P1,P2 (no calibration, no fit: measured figures)")
    args = ap.parse_args()
    if args.refit:
        return refit(args)
    if args.scale:
        return scale(args)
    # Sync kinds in turn, so a run stopped early still has some of each.
    kinds = [[s for s in VALIDATION if s.sync == k] for k in ("flat", "hierarchical", "diloco")]
    order = [s for group in itertools.zip_longest(*kinds) for s in group if s is not None]
    validation = [s for s in order if not args.only or s.name in args.only.split(",")]
    calibration = list(CALIBRATION)
    if args.small:
        args.steps, calibration, validation = 8, calibration[:2], [VALIDATION[0], VALIDATION[13]]
    if args.probes:
        calibration, validation = [], [s for s in PROBES if s.name in args.probes.split(",")]

    from multiregion_bench import WEIGHTS, make_split
    from servers import SeaweedS3

    from geoshard.sim.calibrated import REHEARSAL, dump_constants
    from geoshard.trainer.launch import RegionNet
    from geoshard.wan import Rehearsal, load_matrix, netns

    t_start = time.monotonic()
    matrix = load_matrix(args.matrix)
    args.data.mkdir(parents=True, exist_ok=True)
    split = args.split = make_split(args.data, args.samples, args.sample_bytes, args.shard_samples)
    shards = [p.stat().st_size for p in split.rglob("*.tar")]
    args.shard_bytes = round(statistics.fmean(shards))
    work = Path(tempfile.mkdtemp(prefix="simulate-runs-", dir=args.data))
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    res: dict[str, Any] = {"config": config, "calibration": [], "validation": []}
    if args.resume and args.json_out.exists():
        res = json.loads(args.json_out.read_text())
        res["config"]["resumed"] = res["config"].get("resumed", 0) + 1
    try:
        with SeaweedS3(work / "weed") as server:
            env = server.env(endpoint=False)
            sync(split, server, {**os.environ, **env}, work)
            with Rehearsal(matrix, regions=tuple(WEIGHTS)) as wan:
                res["ceiling"] = {"packets_per_s": round(wan.ceiling.packets_per_s), "mb_per_s": round(wan.ceiling.mb_per_s, 1)}
                print(wan.ceiling, flush=True)
                endpoints = {r: "http://{}:{}".format(*wan.expose(r, server.port)) for r in WEIGHTS}
                net = RegionNet(
                    address=wan.address,
                    wrap=wan.exec_argv,
                    env=lambda r: {**wan.env(r), "TORCH_CPP_LOG_LEVEL": "ERROR"},
                    inside=lambda r: netns.inside(wan.netns(r)),
                )
                for kind, specs in (("calibration", calibration), ("validation", validation)):
                    for spec in specs:
                        if any(row["spec"]["name"] == spec.name for row in res[kind]):
                            continue
                        print(f"{kind} {spec.name}: {spec} ... (load {os.getloadavg()[0]:.1f})", flush=True)
                        row = run_one(spec, wan, net, endpoints, env, work, args)
                        row["ceiling_mb_s"] = round(wan.ceiling.mb_per_s, 1)
                        res[kind].append(row)
                        print(f"  {row['seconds']} s: {json.dumps(row['measured'])}", flush=True)
                        args.json_out.parent.mkdir(parents=True, exist_ok=True)
                        args.json_out.write_text(json.dumps(res, indent=1))  # what ran so far survives a stop
                    if kind == "calibration" and calibration:  # shown early; refit() below is what counts
                        try:
                            print(dump_constants(fit(res["calibration"], replace(REHEARSAL, ceiling_mb_s=wan.ceiling.mb_per_s), args)))
                        except Exception as e:  # the runs go on; --refit fits again from the JSON
                            print(f"fit failed ({e!r}); --refit can redo it from {args.json_out}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["ceiling_mb_s"] = res["ceiling"]["mb_per_s"]
    res["seconds"] = round(time.monotonic() - t_start, 1)
    args.json_out.write_text(json.dumps(res, indent=1))
    return 0 if args.probes else refit(args)


def refit(args: argparse.Namespace) -> int:
    """Fit the constants on the calibration runs, predict every run with them, tabulate the errors."""
    from geoshard.sim.calibrated import REHEARSAL, dump_constants

    res = json.loads(args.json_out.read_text())
    for k in ("steps", "batch_size", "step_time", "samples", "sample_bytes", "shard_bytes", "shard_samples"):
        setattr(args, k, res["config"][k])
    args.matrix = Path(res["config"]["matrix"])
    constants = fit(res["calibration"], replace(REHEARSAL, ceiling_mb_s=res["ceiling"]["mb_per_s"]), args)
    res["constants"] = dump_constants(constants)
    path = args.json_out.with_suffix(".constants.toml")
    path.write_text(res["constants"])
    for row in res["calibration"] + res["validation"]:
        row["predicted"] = predict_one(row, path, args)
    res["errors"] = errors(res["validation"])
    res["errors_calibration"] = errors(res["calibration"])
    p2p = [r for r in res["validation"] if r["spec"].get("outer_transport") == "p2p"]
    if p2p:  # the p2p rows apart, and the rest as they were (the store's 20)
        res["errors_p2p"] = errors(p2p)
        res["errors_store"] = errors([r for r in res["validation"] if r not in p2p])
    args.json_out.write_text(json.dumps(res, indent=1))
    print(res["constants"])
    print(markdown(res))
    for key, title in (("errors_p2p", "p2p validation runs alone:"), ("errors_store", "the other validation runs:")):
        if key in res:
            print(title)
            print(markdown(res, key))
    print("calibration runs (their own fit):")
    print(markdown(res, "errors_calibration"))
    print(f"JSON: {args.json_out} ({len(res['validation'])} validation runs; constants {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
