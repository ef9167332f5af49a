"""The main job on an embedded default, end to end on one machine.

1. Synthesize a corpus and split it for three regions (Dask).
2. Start a local S3 server (SeaweedFS) with one bucket per region and sync each region to it.
3. Train one DDP job across the three regions (one torchrun agent per region, hierarchical
   gradient sync), each rank reading through its own region's tier chain: the Alluxio address
   points at a port where nothing runs, so the chain falls back to the region's (empty) local
   replica and the region's bucket, and write-back fills the replica for the following epochs.
   Nothing is read from another region's bucket.
4. Report the IO-wait share against the budget.
5. Under the WAN rehearsal, train the same samples again with DiLoCo (a short H, the exchange
   behind training) and set both runs' utilization and bytes across regions side by side: the
   report's advice for a job bound by its gradient sync, measured.

Everything started here is stopped before returning, also on errors and Ctrl-C. The plan is
written next to the output so users can start their own from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geoshard.errors import GeoshardError
from geoshard.local.synth import SynthSpec, synth
from geoshard.plan import Plan, parse_plan
from geoshard.split import SplitResult, SplitSettings, run_split
from geoshard.split.job import ProgressFn
from geoshard.util.units import human_bytes

if TYPE_CHECKING:
    from geoshard.trainer.config import RegionRanks, TrainConfig

WAN_STEP_TIME_S = 0.2  # stated compute per step under the rehearsal (TrainConfig.step_time)
_SYNC_TIMEOUT_S = 3600.0  # the whole sync; each S3 request and s5cmd call has its own bound inside

DEMO_PLAN = """\
# geoshard demo plan: three regions, weighted by their share of training compute (one rank each).
[routing]
policy = "hash"          # "hash" | "field" | "replicate"

[shards]
bytes = "4MB"

[regions.us-east-1]
weight = 1
bucket = "s3://geoshard-demo-use1/train"

[regions.eu-west-1]
weight = 1
bucket = "s3://geoshard-demo-euw1/train"

[regions.ap-southeast-1]
weight = 1
bucket = "s3://geoshard-demo-apse1/train"
"""


class DemoFailed(GeoshardError):
    exit_code = 1


@dataclass(frozen=True)
class DemoSettings:
    out: Path
    samples: int = 20_000
    sample_bytes: int = 3_000
    shard_samples: int = 1_000
    workers: int | None = None
    train: bool = True  # False: synthesize and split only (the split-only demo of earlier versions)
    regions: str = "us-east-1:1,eu-west-1:1,ap-southeast-1:1"  # ranks per region (two cores here)
    steps: int = 600
    hidden: int = 1024
    batch_size: int = 32
    wan: Path | None = None  # a latency/bandwidth matrix: train under the WAN rehearsal (root)


@dataclass
class DemoResult:
    plan: Plan
    split: SplitResult
    sync: dict[str, Any] | None = None
    report: dict[str, Any] | None = None
    run_dir: Path | None = None
    diloco: dict[str, Any] | None = None  # under the rehearsal: the DiLoCo run's report
    diloco_run_dir: Path | None = None
    outer_steps: tuple[int, int] = (0, 0)  # the DiLoCo run's H and overlap
    seconds: dict[str, float] = field(default_factory=dict)


Echo = Callable[[str], None]


def storage_plan(base: str, endpoint: str, alluxio_port: int, replicas: Path) -> str:
    """The demo plan with the local S3 server's endpoint, and every region's cache tiers."""
    lines = []
    current = None
    for line in base.splitlines():
        lines.append(line)
        if line.startswith("[regions."):
            current = line[len("[regions.") : -1]
        if line.startswith("bucket = ") and current:
            lines.append(f'endpoint = "{endpoint}"')
            lines.append(f'alluxio = "http://127.0.0.1:{alluxio_port}"  # nothing listens here: the chain falls back')
            lines.append(f'local = "{replicas / current}"')
    return "\n".join(lines) + "\n"


def run_demo(settings: DemoSettings, progress: ProgressFn | None = None, echo: Echo = print) -> DemoResult:
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.toml"
    plan_path.write_text(DEMO_PLAN)
    plan = parse_plan(DEMO_PLAN, source=str(plan_path))
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    corpus = out / "corpus"
    if not (corpus / "train-00000.tar").exists():
        synth(
            SynthSpec(
                out=corpus, fmt="wds", samples=settings.samples, sample_bytes=settings.sample_bytes, shard_samples=settings.shard_samples
            )
        )
    seconds["synth"] = time.monotonic() - t0
    t0 = time.monotonic()
    split = run_split([str(corpus)], plan, SplitSettings(out=out / "split", workers=settings.workers, replace=True), progress=progress)
    seconds["split"] = time.monotonic() - t0
    result = DemoResult(plan=plan, split=split, seconds=seconds)
    if settings.train:
        _sync_and_train(settings, result, echo)
    return result


def _sync_and_train(settings: DemoSettings, result: DemoResult, echo: Echo) -> None:
    from geoshard.local.ports import closed_port
    from geoshard.local.seaweed import SeaweedS3
    from geoshard.trainer.config import parse_regions
    from geoshard.trainer.report import build_report, write_report

    out, seconds = settings.out, result.seconds
    regions = parse_regions(settings.regions)
    t0 = time.monotonic()
    server = SeaweedS3((out / "s3").resolve())
    try:
        server.start()
        seconds["s3_start"] = time.monotonic() - t0
        echo(f"local S3 server (SeaweedFS) on {server.endpoint}, data in {out / 's3'}")  # as the user named it, not resolved
        text = storage_plan(DEMO_PLAN, server.endpoint, closed_port(), (out / "replica").resolve())
        plan_path = out / "plan.toml"
        plan_path.write_text(text)
        result.plan = parse_plan(text, source=str(plan_path))
        # The local server's generated credentials go to what the demo starts (the sync, the
        # ranks), never into this process's environment.
        credentials = server.env(endpoint=False)
        result.sync = _sync(out / "split", plan_path, credentials, echo, seconds)
        cfg = _train(settings, regions, plan_path, credentials, echo, seconds)
        result.run_dir = cfg.out
        # Written again once every rank has finished (rank 0 wrote it at its own end).
        result.report = build_report(cfg.out, cfg.budget)
        write_report(cfg.out, result.report)
        if settings.wan is not None:
            diloco = _train_diloco(settings, cfg, regions, credentials, echo, seconds)
            result.diloco_run_dir, result.outer_steps = diloco.out, (diloco.outer_steps, diloco.outer_overlap)
            result.diloco = build_report(diloco.out, diloco.budget)
            write_report(diloco.out, result.diloco)
    finally:
        t0 = time.monotonic()
        server.stop()
        seconds["s3_stop"] = time.monotonic() - t0


def _sync(split: Path, plan_path: Path, credentials: Mapping[str, str], echo: Echo, seconds: dict[str, float]) -> dict[str, Any]:
    """``geoshard sync --json`` as a child with the server's credentials; its report."""
    argv = [sys.executable, "-P", "-m", "geoshard.cli", "sync", str(split), "--plan", str(plan_path), "--create-buckets", "--json"]
    t0 = time.monotonic()
    # stderr is the user's: the child's one-line errors appear there as they would from the CLI.
    try:
        done = subprocess.run(  # noqa: S603 - an argv list, no shell: this interpreter and fixed arguments
            argv, env={**os.environ, **credentials}, stdout=subprocess.PIPE, text=True, check=False, timeout=_SYNC_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise DemoFailed(f"sync ran past {_SYNC_TIMEOUT_S:g} s and was stopped") from None
    seconds["sync"] = time.monotonic() - t0
    try:
        report = json.loads(done.stdout)
    except ValueError:
        raise DemoFailed(f"sync failed (geoshard sync exit {done.returncode}); its error is above") from None
    if not report["ok"]:
        errors = "; ".join(f"{n}: {r['error']}" for n, r in report["regions"].items() if r["error"])
        raise DemoFailed(f"sync failed: {errors}")
    uploaded = sum(r["uploaded"] for r in report["regions"].values())
    echo(f"synced {uploaded} shards to {len(report['regions'])} buckets in {seconds['sync']:.1f} s")
    return dict(report)


def _train(
    settings: DemoSettings,
    regions: Sequence[RegionRanks],
    plan_path: Path,
    credentials: Mapping[str, str],
    echo: Echo,
    seconds: dict[str, float],
) -> TrainConfig:
    """One DDP job across the regions, from a cold local replica; its config."""
    from geoshard.trainer.launch import launch_regions

    replicas = (settings.out / "replica").resolve()
    if replicas.exists():  # a rerun starts cold, so the fallback shows again
        shutil.rmtree(replicas)
    cfg = _train_config(settings, plan_path)
    where = ", ".join(f"{r.nproc} in {r.region}" for r in regions)
    echo(f"training: one DDP job, {sum(r.nproc for r in regions)} ranks ({where}), {settings.steps} steps (torchrun, gloo)")
    t0 = time.monotonic()
    if settings.wan is not None:
        from geoshard.wan.launch import launch_under_wan

        code = launch_under_wan(cfg, regions, 0, settings.wan, echo, env=credentials)
    else:
        code = launch_regions(cfg, regions, env=credentials)
    seconds["train"] = time.monotonic() - t0
    if code != 0:
        raise DemoFailed(f"training failed (torchrun exit {code}); the ranks' errors are above")
    return cfg


def _train_diloco(
    settings: DemoSettings,
    ddp: TrainConfig,
    regions: Sequence[RegionRanks],
    credentials: Mapping[str, str],
    echo: Echo,
    seconds: dict[str, float],
) -> TrainConfig:
    """The same samples (steps, batch, micro-batches) with DiLoCo under the same rehearsal."""
    from geoshard.wan.launch import launch_under_wan

    assert settings.wan is not None
    cfg = diloco_config(ddp)
    replicas = (settings.out / "replica").resolve()
    if replicas.exists():  # from a cold replica as the DDP run was
        shutil.rmtree(replicas)
    echo(f"training again with DiLoCo: each region alone, an outer round every {cfg.outer_steps} steps behind {cfg.outer_overlap} steps")
    t0 = time.monotonic()
    code = launch_under_wan(cfg, regions, 0, settings.wan, echo, env=credentials)
    seconds["train_diloco"] = time.monotonic() - t0
    if code != 0:
        raise DemoFailed(f"training with DiLoCo failed (exit {code}); the ranks' errors are above")
    return cfg


def diloco_config(ddp: TrainConfig) -> TrainConfig:
    """DiLoCo's run next to ``ddp``: a short H (two rounds in the demo's steps), half of it overlapped."""
    h = max(2, ddp.steps // 2)
    return dataclasses.replace(ddp, out=ddp.out.with_name(ddp.out.name + "-diloco"), sync="diloco", outer_steps=h, outer_overlap=h // 2)


def side_by_side(result: DemoResult) -> list[str]:
    """Under the rehearsal, the two runs' utilization, step time and bytes across regions (the
    forwarder's count), a line each; nothing without a DiLoCo run."""
    ddp, diloco = result.report, result.diloco
    if ddp is None or diloco is None or result.run_dir is None or result.diloco_run_dir is None:
        return []
    h, overlap = result.outer_steps
    rows = [("hierarchical DDP", ddp, result.run_dir), (f"DiLoCo, H={h}, overlap {overlap}", diloco, result.diloco_run_dir)]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"the same corpus and {ddp['steps']} steps, two ways across the WAN rehearsal:"]
    for name, r, run in rows:
        step = r["breakdown"]["wall"]["seconds"] / max(1, r["world_size"] * r["steps"])
        lines.append(
            f"  {name:<{width}}  {r['samples']:>7,} samples  compute utilization {r['utilization']['share']:6.1%}"
            f"  step {step * 1000:5.0f} ms"
            f"  across regions {human_bytes(_crossed(run)):>9}  ({run})"
        )
    return lines


def _crossed(run: Path) -> int:
    """Bytes that crossed between regions in the run (RUN_DIR/wan.json, written by the rehearsal)."""
    try:
        links = json.loads((run / "wan.json").read_text())["links"]
        return sum(int(x["bytes"]) for x in links)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _train_config(settings: DemoSettings, plan_path: Path) -> TrainConfig:
    from geoshard.trainer.config import TrainConfig

    cfg = TrainConfig(
        plan=plan_path,
        out=settings.out / "run",
        steps=settings.steps,
        hidden=settings.hidden,
        batch_size=settings.batch_size,
        checkpoint_every=max(1, settings.steps // 4),
    )
    if settings.wan is None:
        return cfg
    # Long links: the seed's advice (accumulate 4 micro-batches per exchange, fp16 across regions).
    # A narrower model too: its step is bound by the round trips, not by the bytes. The stated
    # compute stands for a real model's step: against the MLP's few milliseconds any exchange
    # across regions, DiLoCo's rounds included, would be all of the wall.
    return dataclasses.replace(
        cfg,
        accum_steps=4,
        grad_compression="fp16",
        hidden=min(cfg.hidden, 256),
        checkpoint_every=max(1, settings.steps // 2),
        step_time=WAN_STEP_TIME_S,
    )


# The demo's WAN: one-way latencies as between those AWS regions, caps of a shared inter-region link.
DEMO_WAN = """\
[[link]]
a = "us-east-1"
b = "eu-west-1"
latency_ms = 38
bandwidth_mbit = 400

[[link]]
a = "us-east-1"
b = "ap-southeast-1"
latency_ms = 110
bandwidth_mbit = 200

[[link]]
a = "eu-west-1"
b = "ap-southeast-1"
latency_ms = 85
bandwidth_mbit = 200
"""
