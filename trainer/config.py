"""The trainer's settings: one frozen dataclass, built from the command line at the edge.

``geoshard train`` and ``python -m geoshard.trainer`` share the option list (``options.py``);
``to_argv`` turns a config back into the latter's arguments so ``geoshard train`` can hand it to
torchrun unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from geoshard.errors import ConfigError
from geoshard.plan.names import check_region_name

BACKENDS = ("auto", "gloo", "nccl")
COMPRESSIONS = ("none", "fp16")
SYNCS = ("auto", "flat", "hierarchical", "diloco")
OUTER_COMPRESSIONS = ("fp16", "bf16", "none", "int8", "fp8")  # of DiLoCo's pseudo-gradients on the long links (diloco/codec.py)
INNER_OPTIMIZERS = ("sgd", "adamw")
OUTER_TRANSPORTS = ("store", "p2p")  # how they travel: through the outer store, or over gloo between the ranks
MODELS = ("mlp", "none")  # none: no model, the data path alone (a stated compute time per step)
NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
_REGION_SPEC = re.compile(r"^([^:]+):([0-9]+)$")
_HOST_PORT = re.compile(r"^([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\]):([0-9]{1,5})$")


@dataclass(frozen=True)
class RegionRanks:
    region: str
    nproc: int


def parse_regions(text: str, option: str = "--regions") -> tuple[RegionRanks, ...]:
    """``us-east-1:2,eu-west-1:1`` → ranks per region; a ConfigError naming the part that is wrong."""
    out: list[RegionRanks] = []
    for part in (p.strip() for p in text.split(",")):
        m = _REGION_SPEC.match(part)
        if not m or int(m.group(2)) < 1:
            raise ConfigError(f"{option}: {part!r} is not REGION:RANKS with RANKS >= 1 (e.g. us-east-1:2,eu-west-1:1)")
        check_region_name(m.group(1), option)
        if any(r.region == m.group(1) for r in out):
            raise ConfigError(f"{option}: {m.group(1)} appears twice")
        out.append(RegionRanks(m.group(1), int(m.group(2))))
    return tuple(out)


def parse_host_port(text: str, option: str) -> tuple[str, int]:
    m = _HOST_PORT.match(text)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(f"{option}: {text!r} is not HOST:PORT (e.g. 10.0.0.5:29600)")
    return m.group(1).strip("[]"), int(m.group(2))


@dataclass(frozen=True)
class TrainConfig:
    plan: Path
    out: Path
    steps: int
    region: str | None = None
    batch_size: int = 32
    accum_steps: int = 1
    lr: float = 0.05
    hidden: int = 128  # width of the model's hidden layers: the compute per step
    seed: int = 0
    num_workers: int = 2
    prefetch: int = 2
    shuffle_buffer: int = 1000
    grad_compression: str = "none"
    sync: str = "auto"  # auto: hierarchical when the job spans regions
    fp32_after: int | None = None  # step from which gradients are exchanged in fp32 again
    checkpoint: str | None = None  # folder or s3://bucket/prefix; default RUN_DIR/checkpoints
    checkpoint_every: int = 50
    checkpoint_keep: int = 2
    checkpoint_endpoint: str | None = None
    checkpoint_region: str | None = None  # the s3:// checkpoint bucket's AWS region (None: the SDK's, e.g. AWS_REGION)
    resume: bool = False
    backend: str = "auto"
    nccl_algo: str | None = None
    socket_ifname: str | None = None
    metrics_port: int | None = None  # rank r serves on metrics_port + r
    metrics_host: str = "127.0.0.1"  # the address the metrics bind: 0.0.0.0 for a Prometheus on another host
    budget: float = 0.05
    log_keys: bool = False  # every step's sample keys into keys-rank{R}.jsonl (for audits and tests)
    follow_refresh: bool = False  # at an epoch boundary, move to the newest generation every region published
    allow_cross_region: bool | None = None  # None: the plan's [egress] cross_region (off unless set)
    collective_timeout: int = 600  # seconds a collective may wait for a peer before the rank fails
    model: str = "mlp"  # the built-in MLP (WebDataset img/cls samples), or "none": any layout, data only
    input_field: tuple[str, ...] = ("img",)  # fields (TFRecord features) the built-in model's input is made of
    label_field: str = "cls"  # the field (feature) holding its integer label
    step_time: float = 0.0  # seconds of simulated compute per step (with model "none": the whole step)
    # --sync diloco (trainer/diloco/): each region trains alone; every outer_steps steps the regions
    # average their pseudo-gradients through the outer store and take an outer Nesterov SGD step.
    outer_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_compression: str = "fp16"
    outer_error_feedback: bool = True  # carry what the compression dropped into the next round
    outer_timeout: float = 120.0  # seconds a region leader waits for the others at a round
    outer_overlap: int = 0  # inner steps a round's exchange runs behind training (0: each round waits)
    outer_store: str | None = None  # HOST:PORT of the store the region leaders meet in (geoshard train hosts it)
    outer_regions: str | None = None  # the job's regions and ranks, REGION:RANKS,... (the same on every region)
    outer_secret_file: str | None = None  # the job's secret that signs the store's values (its path, never the secret)
    outer_transport: str = "p2p"  # p2p: pseudo-gradients over gloo, sharded over every rank; the store for membership
    outer_streams: int = 8  # p2p: concurrent all-reduces (TCP streams) per pair of regions, as the CLI
    outer_wan: str | None = None  # p2p: a WAN matrix (TOML) that orders the exchange's rings (geoshard train --wan sets it)
    utilization_target: float = 0.95  # compute time / wall time the report holds the job to
    # A flat job across regions: REGION:RANKS,... that numbers its ranks (trainer/rankorder.py);
    # None: torchrun's numbering. geoshard train --regions sets it.
    rank_order: str | None = None
    inner_optimizer: str = "sgd"  # sgd (momentum 0.9) or adamw (the DiLoCo paper's inner optimizer)
    weight_decay: float = 0.1  # adamw's
    warmup_steps: int = 0  # linear learning-rate warm-up over the first steps (0: none)

    def __post_init__(self) -> None:
        self._check_basics()
        if self.outer_steps < 1:
            raise ConfigError(f"--outer-steps must be at least 1, got {self.outer_steps}")
        if not self.outer_lr > 0:
            raise ConfigError(f"--outer-lr must be above 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be at least 0 and below 1, got {self.outer_momentum}")
        if self.outer_compression not in OUTER_COMPRESSIONS:
            raise ConfigError(f"--outer-compression must be one of {', '.join(OUTER_COMPRESSIONS)}, got {self.outer_compression!r}")
        if self.outer_transport not in OUTER_TRANSPORTS:
            raise ConfigError(f"--outer-transport must be one of {', '.join(OUTER_TRANSPORTS)}, got {self.outer_transport!r}")
        if not 1 <= self.outer_streams <= 64:
            raise ConfigError(f"--outer-streams must be 1 to 64, got {self.outer_streams}")
        if not 0 <= self.outer_overlap < self.outer_steps:
            raise ConfigError(f"--outer-overlap must be at least 0 and below --outer-steps ({self.outer_steps}), got {self.outer_overlap}")
        if not 0 < self.outer_timeout <= 86400:
            raise ConfigError(f"--outer-timeout must be above 0 and at most a day, got {self.outer_timeout}")
        if not 0 < self.utilization_target <= 1:
            raise ConfigError(f"--utilization-target must lie in (0, 1], got {self.utilization_target}")
        if self.outer_store is not None:
            parse_host_port(self.outer_store, "--outer-store")
            if self.outer_secret_file is None:
                raise ConfigError(
                    "--outer-store needs --outer-secret-file (or GEOSHARD_OUTER_SECRET_FILE): a file only you can read, "
                    "the same on every region, e.g. head -c 32 /dev/urandom > FILE; chmod 600 FILE"
                )
        if self.rank_order is not None:
            parse_regions(self.rank_order, "--rank-order")
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ConfigError(f"--inner-optimizer must be one of {', '.join(INNER_OPTIMIZERS)}, got {self.inner_optimizer!r}")
        if not 0 <= self.weight_decay < 1:
            raise ConfigError(f"--weight-decay must be at least 0 and below 1, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be at least 0, got {self.warmup_steps}")
        if self.outer_regions is not None:
            regions = parse_regions(self.outer_regions, "--outer-regions")
            if self.region is not None and self.region not in [r.region for r in regions]:
                raise ConfigError(f"--region {self.region} is not one of --outer-regions ({self.outer_regions})")

    @property
    def job_regions(self) -> tuple[RegionRanks, ...]:
        """The job's regions (``--outer-regions``); empty outside DiLoCo."""
        return parse_regions(self.outer_regions, "--outer-regions") if self.outer_regions else ()

    @property
    def rank_regions(self) -> tuple[RegionRanks, ...]:
        """The order that numbers a flat job's ranks (``--rank-order``); empty: torchrun's."""
        return parse_regions(self.rank_order, "--rank-order") if self.rank_order else ()

    def _check_basics(self) -> None:
        for name in ("steps", "batch_size", "accum_steps", "checkpoint_every", "checkpoint_keep", "hidden", "collective_timeout"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.grad_compression not in COMPRESSIONS:
            raise ConfigError(f"--grad-compression must be one of {', '.join(COMPRESSIONS)}, got {self.grad_compression!r}")
        if self.sync not in SYNCS:
            raise ConfigError(f"--sync must be one of {', '.join(SYNCS)}, got {self.sync!r}")
        if not 0 < self.budget < 1:
            raise ConfigError(f"--budget must lie between 0 and 1, got {self.budget}")
        for name, low in (("num_workers", 0), ("prefetch", 0), ("shuffle_buffer", 1), ("fp32_after", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
        if self.model not in MODELS:
            raise ConfigError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        for name in (*self.input_field, self.label_field):
            if not name or name != name.strip() or name.startswith("__"):
                raise ConfigError(f"--input-field and --label-field name a sample's field, such as jpg or cls; got {name!r}")
        if not self.input_field or len(set(self.input_field)) != len(self.input_field):
            raise ConfigError(f"--input-field must name one or more distinct fields, got {', '.join(self.input_field) or 'none'}")
        if not 0 <= self.step_time < 3600:
            raise ConfigError(f"--step-time must be at least 0 and under an hour, got {self.step_time}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be above 0, got {self.lr}")
        if not self.metrics_host or any(c.isspace() for c in self.metrics_host):
            raise ConfigError(f"--metrics-host must be an address such as 127.0.0.1 or 0.0.0.0, got {self.metrics_host!r}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be a TCP port (1-65535; rank R serves on PORT+R), got {self.metrics_port}")

    @property
    def checkpoint_target(self) -> str:
        return self.checkpoint or str(self.out / "checkpoints")

    def region_checkpoint_target(self, region: str) -> str:
        """Under DiLoCo each region keeps its own checkpoints: a region restarts alone."""
        return self.checkpoint_target.rstrip("/") + f"/{region}"

    def to_argv(self) -> list[str]:
        """The same config as ``python -m geoshard.trainer`` arguments."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                if value != f.default:
                    argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, tuple):  # a repeatable option
                argv += [x for v in value for x in (flag, str(v))]
            elif value is not None:
                argv += [flag, str(value)]
        return argv
