"""What the search is given: a base ``SimConfig`` (the regions with their ranks, the links, the
model and loader options, the prices), the input plan when there is one, and the budgets."""

from __future__ import annotations

import math
from dataclasses import dataclass

from geoshard.errors import ConfigError
from geoshard.plan.model import Plan
from geoshard.sim.config import SimConfig


@dataclass(frozen=True)
class Budgets:
    io_wait: float = 0.05  # IO wait after the first batch, a share of wall time (report.json's name)
    utilization: float = 0.9  # compute over wall time, at least
    egress_usd: float | None = None  # USD per epoch (copies spread over --epochs); None: no cap

    def __post_init__(self) -> None:
        if not 0 < self.io_wait < 1:
            raise ConfigError(f"--io-wait-budget must be a share between 0 and 1, got {self.io_wait}")
        if not 0 < self.utilization <= 1:
            raise ConfigError(f"--utilization must be a share above 0 and at most 1, got {self.utilization}")
        if self.egress_usd is not None and not (math.isfinite(self.egress_usd) and self.egress_usd >= 0):
            raise ConfigError(f"--egress-budget must be USD >= 0, got {self.egress_usd}")


@dataclass(frozen=True)
class OptimizeInputs:
    """``base``: the job as ``geoshard simulate`` would model it, each region's ``samples`` its share
    of the corpus at the weights the search proposes (ranks), ``steps`` one epoch.
    ``source_region``: where the corpus is split and uploaded from (a copy into another region's
    bucket is egress from it). ``plan``: buckets, replicas, Alluxio and routing to keep; None:
    the written plan holds weights and replicas only."""

    base: SimConfig
    corpus_bytes: float
    source_region: str
    budgets: Budgets = Budgets()
    plan: Plan | None = None
    epochs: int = 1  # epochs the corpus is trained: a copy's egress is spread over them
    max_outer_steps: int = 100  # DiLoCo's H at most (a larger H saves egress but converges slower)
    local_root: str = "/var/lib/geoshard"  # a proposed replica folder: LOCAL_ROOT/<region>

    def __post_init__(self) -> None:
        names = [r.name for r in self.base.regions]
        if self.source_region not in names:
            raise ConfigError(f"--source-region: {self.source_region} is not one of the job's regions ({', '.join(names)})")
        if self.epochs < 1 or self.max_outer_steps < 1:
            raise ConfigError("--epochs and --max-outer-steps must be at least 1")
        if not (math.isfinite(self.corpus_bytes) and self.corpus_bytes > 0):
            raise ConfigError(f"plan optimize: the corpus must have a size above 0, got {self.corpus_bytes}")
        if self.plan is not None:
            for r in names:
                self.plan.region(r)  # one line naming the plan's regions when the job has another

    @property
    def residency(self) -> bool:
        """The plan routes samples by a field of theirs (data residency): a region's samples stay in it."""
        return self.plan is not None and self.plan.routing.policy == "field"

    @property
    def replicate(self) -> bool:
        return self.plan is not None and self.plan.routing.policy == "replicate"

    def share_bytes(self, region: str) -> float:
        """The bytes of the corpus a region holds at weights proportional to ranks."""
        if self.replicate:
            return self.corpus_bytes
        ranks = {r.name: r.ranks for r in self.base.regions}
        return self.corpus_bytes * ranks[region] / sum(ranks.values())
