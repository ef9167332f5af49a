"""The main job on an embedded default, end to end on one machine.

1. Synthesize a corpus and split it for three regions (Dask).
2. Start a local S3 server (SeaweedFS) with one bucket per region and sync each region to it.
3. Train one DDP job across the three regions (one torchrun agent per region, hierarchical
   gradient sync), each rank reading through its own region's tier chain: the Alluxio address
   points at a port where nothing runs, so the chain falls back to the region's (empty) local
   replica and the region's bucket, and write-back fills the replica for the following epochs.
   Nothing is read from another region's bucket.
4. Report the IO-wait share against the budget.

Everything started here is stopped before returning, also on errors and Ctrl-C. The plan is
written next to the output so users can start their own from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoshard.errors import GeoshardError
from geoshard.local.synth import SynthSpec, synth
from geoshard.plan import Plan, parse_plan
from geoshard.split import SplitResult, SplitSettings, run_split
from geoshard.split.job import ProgressFn

REGION_BUCKETS = {"us-east-1": "geoshard-demo-use1", "eu-west-1": "geoshard-demo-euw1", "ap-southeast-1": "geoshard-demo-apse1"}

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


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    # The local server's generated credentials, for s5cmd and the ranks (children inherit them).
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    from geoshard.local.seaweed import SeaweedS3, closed_port
    from geoshard.sync.push import SyncSettings
    from geoshard.sync.push import sync as run_sync
    from geoshard.trainer.config import TrainConfig, parse_regions
    from geoshard.trainer.launch import launch_regions
    from geoshard.trainer.report import build_report

    out, seconds = settings.out, result.seconds
    regions = parse_regions(settings.regions)
    replicas = (out / "replica").resolve()
    t0 = time.monotonic()
    server = SeaweedS3((out / "s3").resolve())
    try:
        server.start()
        seconds["s3_start"] = time.monotonic() - t0
        echo(f"local S3 server (SeaweedFS) on {server.endpoint}, data in {out / 's3'}")  # as the user named it, not resolved
        text = storage_plan(DEMO_PLAN, server.endpoint, closed_port(), replicas)
        plan_path = out / "plan.toml"
        plan_path.write_text(text)
        plan = parse_plan(text, source=str(plan_path))
        result.plan = plan
        with _environment(server.env(endpoint=False)):
            t0 = time.monotonic()
            sync_report = run_sync(out / "split", plan, SyncSettings(create_buckets=True))
            seconds["sync"] = time.monotonic() - t0
            result.sync = sync_report.to_dict()
            if not sync_report.ok:
                errors = "; ".join(f"{n}: {r.error}" for n, r in sync_report.regions.items() if r.error)
                raise DemoFailed(f"sync failed: {errors}")
            uploaded = sum(r.uploaded for r in sync_report.regions.values())
            echo(f"synced {uploaded} shards to {len(sync_report.regions)} buckets in {seconds['sync']:.1f} s")
            if replicas.exists():  # a rerun starts cold, so the fallback shows again
                shutil.rmtree(replicas)
            run_dir = out / "run"
            cfg = TrainConfig(
                plan=plan_path,
                out=run_dir,
                steps=settings.steps,
                hidden=settings.hidden,
                batch_size=settings.batch_size,
                checkpoint_every=max(1, settings.steps // 4),
            )
            if settings.wan is not None:
                # Long links: the seed's advice (accumulate 4 micro-batches per exchange, fp16 across regions).
                # A narrower model too: its step is bound by the round trips, not by the bytes.
                cfg = dataclasses.replace(
                    cfg, accum_steps=4, grad_compression="fp16", hidden=min(cfg.hidden, 256), checkpoint_every=max(1, settings.steps // 2)
                )
            where = ", ".join(f"{r.nproc} in {r.region}" for r in regions)
            echo(f"training: one DDP job, {sum(r.nproc for r in regions)} ranks ({where}), {settings.steps} steps (torchrun, gloo)")
            t0 = time.monotonic()
            if settings.wan is not None:
                from geoshard.wan.launch import launch_under_wan

                code = launch_under_wan(cfg, regions, 0, settings.wan, echo)
            else:
                code = launch_regions(cfg, regions)
            seconds["train"] = time.monotonic() - t0
            if code != 0:
                raise DemoFailed(f"training failed (torchrun exit {code}); the ranks' errors are above")
        result.run_dir = run_dir
        result.report = build_report(run_dir, cfg.budget)
    finally:
        t0 = time.monotonic()
        server.stop()
        seconds["s3_stop"] = time.monotonic() - t0


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
