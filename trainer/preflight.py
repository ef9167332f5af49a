"""What ``geoshard train`` checks before it starts torchrun: everything one process can check
alone (the plan, the region, every option, the corpus layout the model reads), so a mistake is
one line on stderr with its exit code, not a rank's traceback inside 100 lines of torchrun."""

from __future__ import annotations

import re
from collections.abc import Sequence

from geoshard.env import read_environment
from geoshard.errors import ConfigError, DataError
from geoshard.formats import format_spec
from geoshard.plan import Plan, load_plan
from geoshard.plan.names import REGION_NAME
from geoshard.trainer.config import TrainConfig
from geoshard.trainer.published import check_published

# run.json: a StepLog's claim on its folder (trainer/runclaim.py).
_RUN_FILE = re.compile(rf"^(steps-rank\d+\.jsonl|rank\d+\.json|rounds-{REGION_NAME.pattern}\.jsonl|report\.json|run\.json)$")
# What the built-in model reads from each sample by default (--input-field, --label-field).
MODEL_FIELDS = ("img", "cls")


def preflight(
    cfg: TrainConfig, nproc: int, regions: Sequence[str] = (), *, check_layout: bool = True, overwrite: bool = False
) -> list[str]:
    """The regions the job reads (``regions`` of ``--regions``, else the node's region); raises
    ConfigError naming what to change."""
    if not cfg.resume and not overwrite:
        earlier = sorted(p.name for p in cfg.out.glob("*") if _RUN_FILE.match(p.name)) if cfg.out.is_dir() else []
        if earlier:
            raise ConfigError(
                f"{cfg.out}: holds a training run ({', '.join(earlier[:3])}{', ...' if len(earlier) > 3 else ''}); "
                "pass --resume to continue it, --overwrite to start it over, or choose another --out"
            )
    plan = load_plan(cfg.plan)
    names = list(regions) or [node_region(cfg.region, plan)]
    for name in names:
        plan.region(name)  # an unknown region: one line naming the plan's regions
    if cfg.metrics_port is not None and cfg.metrics_port + nproc - 1 > 65535:
        raise ConfigError(f"--metrics-port {cfg.metrics_port}: rank {nproc - 1} would serve on {cfg.metrics_port + nproc - 1}, past 65535")
    check_published(plan, names, str(cfg.plan))  # a region never synced: one line, not a rank's NoSuchKey after torchrun
    if check_layout and cfg.model != "none":  # --model none reads any layout
        for name in names:
            model_layout(plan, name, cfg.input_field, cfg.label_field)
    return names


def node_region(region: str | None, plan: Plan) -> str:
    """``--region``, else GEOSHARD_REGION, else AWS_REGION (what the ranks will resolve)."""
    env = read_environment()
    found = region or env.geoshard_region or env.region
    if not found:
        raise ConfigError(
            f"no region: pass --region REGION or set GEOSHARD_REGION (or AWS_REGION) to the region this node runs in; "
            f"{plan.path or 'the plan'} has {', '.join(plan.region_names)}"
        )
    return found


def model_layout(plan: Plan, region: str, inputs: Sequence[str] = ("img",), label: str = "cls") -> None:
    """The built-in model reads the ``inputs`` and ``label`` fields of WebDataset samples, or those
    features of TFRecord records: check the region's first sample (one shard fetched through the
    region's tier chain), label included."""
    from geoshard.formats.example import ExampleError, parse_example
    from geoshard.loaders import RegionalDataset
    from geoshard.trainer.model import ModelInput

    ds = RegionalDataset(plan, region=region, shuffle=False, prefetch=1, region_rank=0, region_size=1)
    hint = (
        "name yours with --input-field FIELD --label-field FIELD, measure your own data with --model none --step-time 80ms, "
        "or train your model on geoshard.loaders (docs/cli.md)"
    )
    sample = next(iter(ds), None)
    if sample is None:
        raise ConfigError(f"region {region}: its manifest lists no samples")
    named = format_spec(ds.manifest.format).named_fields
    try:
        fields = sample if named else parse_example(bytes(sample))
    except ExampleError:
        fields = {}
    wanted = (*inputs, label)
    have = ", ".join(sorted(k for k in fields if not k.startswith("__"))) or "none"
    if any(f not in fields for f in wanted):
        if not named and wanted == MODEL_FIELDS:  # the defaults: a TFRecord corpus needs its feature names
            raise ConfigError(
                f"region {region}: its shards are {ds.manifest.format}; the built-in model reads WebDataset samples with "
                f"{' and '.join(MODEL_FIELDS)} fields, or the features --input-field and --label-field name (its records "
                f"have {have}); {hint}"
            )
        kind = "samples have" if named else "records have features"
        raise ConfigError(f"region {region}: its {kind} {have}; the built-in model needs {' and '.join(wanted)}; {hint}")
    try:
        ModelInput(tuple(inputs), label)([sample])
    except DataError as e:
        raise ConfigError(f"region {region}: {e}") from None
