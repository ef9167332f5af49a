"""The trainer's command-line options, shared by ``geoshard train`` and ``python -m geoshard.trainer``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from geoshard.trainer.config import (
    BACKENDS,
    COMPRESSIONS,
    INNER_OPTIMIZERS,
    MODELS,
    NCCL_ALGOS,
    OUTER_COMPRESSIONS,
    OUTER_TRANSPORTS,
    SYNCS,
    TrainConfig,
)
from geoshard.util.units import parse_duration

F = TypeVar("F", bound=Callable[..., Any])


class _Duration(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            return parse_duration(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


DURATION = _Duration()  # "80ms", "2s": also for the commands that take train's step time

_OPTIONS = [
    click.option("--plan", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Region plan (TOML)."),
    click.option("--region", help="Region of this node's ranks (default: GEOSHARD_REGION, then AWS_REGION)."),
    click.option("--steps", required=True, type=int, help="Optimizer steps to train."),
    click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Run folder (RUN_DIR)."),
    click.option("--batch-size", default=32, show_default=True, type=int, help="Samples per micro-batch and rank."),
    click.option("--accum-steps", default=1, show_default=True, type=int, help="Micro-batches per optimizer step (2-4 on long links)."),
    click.option("--lr", default=0.05, show_default=True, type=float),
    click.option("--hidden", default=128, show_default=True, type=int, help="Width of the model's two hidden layers."),
    click.option("--seed", default=0, show_default=True, type=int),
    click.option(
        "--inner-optimizer",
        type=click.Choice(INNER_OPTIMIZERS),
        default="sgd",
        show_default=True,
        help="sgd (momentum 0.9) or adamw (betas 0.9, 0.95; --weight-decay): DiLoCo's paper trains with AdamW at --lr 4e-4.",
    ),
    click.option("--weight-decay", default=0.1, show_default=True, type=float, help="With --inner-optimizer adamw."),
    click.option("--warmup-steps", default=0, show_default=True, type=int, help="Linear learning-rate warm-up over the first steps."),
    click.option("--num-workers", default=2, show_default=True, type=int, help="DataLoader workers per rank."),
    click.option("--prefetch", default=2, show_default=True, type=int, help="Shards fetched ahead per worker."),
    click.option("--shuffle-buffer", default=1000, show_default=True, type=int),
    click.option("--grad-compression", type=click.Choice(COMPRESSIONS), default="none", show_default=True),
    click.option(
        "--sync",
        type=click.Choice(SYNCS),
        default="auto",
        show_default=True,
        help="Gradient sync: flat all-reduce, or hierarchical (in region, then region leaders); auto: hierarchical across "
        "regions; diloco: DDP in each region, the regions average pseudo-gradients every --outer-steps steps (docs/diloco.md).",
    ),
    click.option("--outer-steps", default=100, show_default=True, type=int, help="DiLoCo: inner steps between outer rounds (H)."),
    click.option("--outer-lr", default=0.7, show_default=True, type=float, help="DiLoCo: outer learning rate."),
    click.option("--outer-momentum", default=0.9, show_default=True, type=float, help="DiLoCo: outer momentum."),
    click.option("--outer-nesterov/--no-outer-nesterov", default=True, show_default=True, help="DiLoCo: Nesterov outer momentum."),
    click.option(
        "--outer-compression",
        type=click.Choice(OUTER_COMPRESSIONS),
        default="fp16",
        show_default=True,
        help="DiLoCo: the pseudo-gradients' form on the long links (int8, fp8: per-block scales, about half fp16's bytes).",
    ),
    click.option(
        "--outer-error-feedback/--no-outer-error-feedback",
        default=True,
        show_default=True,
        help="DiLoCo: add what the compression dropped in a round to the next round's pseudo-gradient.",
    ),
    click.option(
        "--outer-overlap",
        default=0,
        show_default=True,
        type=int,
        help="DiLoCo: inner steps each round's exchange runs behind training (0: training waits for each round).",
    ),
    click.option(
        "--outer-transport",
        type=click.Choice(OUTER_TRANSPORTS),
        default="p2p",
        show_default=True,
        help="DiLoCo: pseudo-gradients through the outer store, or p2p: over gloo between the regions' ranks, "
        "sharded over every rank (the store for membership only).",
    ),
    click.option(
        "--outer-streams",
        default=8,
        show_default=True,
        type=int,
        help="DiLoCo p2p: concurrent all-reduces (TCP streams) per pair of regions, split over a region's ranks.",
    ),
    click.option("--outer-wan", help="DiLoCo p2p: a WAN matrix (TOML) whose bandwidths order the exchange's rings (--wan sets it)."),
    click.option(
        "--outer-timeout", default=120.0, show_default=True, type=float, help="DiLoCo: seconds a round waits for the other regions."
    ),
    click.option(
        "--outer-store", help="DiLoCo with your own torchrun per region: HOST:PORT of the store the regions meet in (a TCPStore)."
    ),
    click.option("--outer-regions", help="DiLoCo with your own torchrun per region: the job's REGION:RANKS,... (the same everywhere)."),
    click.option(
        "--outer-secret-file",
        envvar="GEOSHARD_OUTER_SECRET_FILE",
        help="DiLoCo with --outer-store: a file (mode 600, the same on every region) holding the job's secret, "
        "which signs every value in the store.",
    ),
    click.option(
        "--rank-order",
        help="A flat job across regions: REGION:RANKS,... in the order that numbers its ranks, one torchrun agent per "
        "region (geoshard train --regions sets it; default: torchrun's numbering, in the order the agents met).",
    ),
    click.option(
        "--utilization-target",
        default=0.95,
        show_default=True,
        type=float,
        help="Compute time / wall time the report holds the job to.",
    ),
    click.option("--fp32-after", type=int, help="With fp16 compression: exchange fp32 gradients from this step on."),
    click.option("--checkpoint", help="Checkpoint folder or s3://bucket/prefix (default: RUN_DIR/checkpoints)."),
    click.option("--checkpoint-every", default=50, show_default=True, type=int),
    click.option("--checkpoint-keep", default=2, show_default=True, type=int),
    click.option("--checkpoint-endpoint", help="S3 endpoint for an s3:// --checkpoint."),
    click.option(
        "--checkpoint-region",
        help="AWS region of an s3:// --checkpoint bucket (default: the SDK's, e.g. AWS_REGION); ranks in other regions need it.",
    ),
    click.option("--resume/--no-resume", default=False, help="Continue from the latest checkpoint if there is one."),
    click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True, help="auto: nccl on CUDA, else gloo."),
    click.option("--nccl-algo", type=click.Choice(NCCL_ALGOS), help="NCCL_ALGO (Tree suits long, high-latency links)."),
    click.option("--socket-ifname", help="Network interface for NCCL and gloo (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)."),
    click.option("--metrics-port", type=int, help="Serve Prometheus metrics on HOST:PORT+rank (HOST: --metrics-host)."),
    click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        help="Address the metrics bind; 0.0.0.0 lets a Prometheus on another host scrape them (docs/prometheus.yml).",
    ),
    click.option("--budget", default=0.05, show_default=True, type=float, help="IO-wait budget, a share of wall time."),
    click.option("--log-keys/--no-log-keys", default=False, help="Record every step's sample keys (audits)."),
    click.option(
        "--follow-refresh/--no-follow-refresh",
        default=False,
        help="Move every region to the newest generation all regions have published, at an epoch boundary (docs/cron.md).",
    ),
    click.option(
        "--allow-cross-region/--no-allow-cross-region",
        default=None,
        help="Read other regions' buckets as a last resort [default: the plan's [egress] cross_region, off unless set].",
    ),
    click.option(
        "--collective-timeout",
        default=600,
        show_default=True,
        type=int,
        help="Seconds a collective waits for a peer, or the loader for a batch from its workers, before the rank fails.",
    ),
    click.option(
        "--model",
        type=click.Choice(MODELS),
        default="mlp",
        show_default=True,
        help="mlp: the built-in model (--input-field, --label-field); none: no model, your data's IO wait alone (any layout).",
    ),
    click.option(
        "--input-field",
        multiple=True,
        default=("img",),
        show_default=True,
        help="Field (TFRecord feature) the built-in model reads, bytes of any length; repeat for several.",
    ),
    click.option(
        "--label-field", default="cls", show_default=True, help="Field (TFRecord feature) with the built-in model's integer label."
    ),
    click.option(
        "--step-time",
        type=DURATION,
        default="0",
        help="Compute time per step to simulate, e.g. 80ms (with --model none: the whole step's compute).",
    ),
]


def train_options(f: F) -> F:
    for option in reversed(_OPTIONS):
        f = option(f)
    return f


def config_from(**kwargs: Any) -> TrainConfig:
    return TrainConfig(**kwargs)
