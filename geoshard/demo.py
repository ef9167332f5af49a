"""The main job on an embedded default: synthesize a corpus, split it for three regions.

``geoshard demo`` (and ``make demo``) runs it; the plan it uses is written next to the output so
users can start their own from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geoshard.plan import Plan, parse_plan
from geoshard.split import SplitResult, SplitSettings, run_split
from geoshard.split.job import ProgressFn
from geoshard.synth import SynthSpec, synth

DEMO_PLAN = """\
# geoshard demo plan: three regions, weighted by their share of training compute.
[routing]
policy = "hash"          # "hash" | "field" | "replicate"

[shards]
bytes = "16MB"

[regions.us-east-1]
weight = 2
bucket = "s3://geoshard-demo-use1/train"

[regions.eu-west-1]
weight = 1
bucket = "s3://geoshard-demo-euw1/train"

[regions.ap-southeast-1]
weight = 1
bucket = "s3://geoshard-demo-apse1/train"
"""


@dataclass(frozen=True)
class DemoSettings:
    out: Path
    samples: int = 20_000
    sample_bytes: int = 3_000
    shard_samples: int = 1_000
    workers: int | None = None


def run_demo(settings: DemoSettings, progress: ProgressFn | None = None) -> tuple[Plan, SplitResult]:
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.toml"
    plan_path.write_text(DEMO_PLAN)
    plan = parse_plan(DEMO_PLAN, source=str(plan_path))
    corpus = out / "corpus"
    if not (corpus / "train-00000.tar").exists():
        synth(
            SynthSpec(
                out=corpus, fmt="wds", samples=settings.samples, sample_bytes=settings.sample_bytes, shard_samples=settings.shard_samples
            )
        )
    result = run_split([str(corpus)], plan, SplitSettings(out=out / "split", workers=settings.workers, replace=True), progress=progress)
    return plan, result
