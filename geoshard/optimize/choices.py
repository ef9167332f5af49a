"""The grid the search walks: sync choices for the whole job, placements per region.

A sync choice is decided for the job (one ring or one round connects every region); where a
region's data lives is decided per region, given the sync choice, since one region's tier does not
change another's loader (geoshard/sim/loader.py): the search costs O(syncs x placements) predictions,
never a product over regions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from geoshard.sim.config import SimConfig

H_GRID = (10, 25, 50, 100, 250, 500)  # DiLoCo's inner steps between rounds, up to --max-outer-steps
# The sim prices bf16 like fp16 (2 bytes) and has no int8: fp16 stands for both 2-byte types.
GRAD_COMPRESSIONS = ("none", "fp16")
OUTER_COMPRESSIONS = ("fp16", "none")
TIERS = ("s3", "local", "alluxio")  # a region's own copy, in the order the search prefers on a tie (fewest parts)


@dataclass(frozen=True)
class SyncChoice:
    sync: str  # flat | hierarchical | diloco
    grad_compression: str = "none"
    outer_steps: int = 0  # H (diloco)
    outer_overlap: int = 0
    outer_compression: str = "fp16"

    @property
    def fidelity(self) -> tuple[int, int, int, int]:
        """Lower is closer to plain synchronous training: preferred when two choices cost the same."""
        if self.sync != "diloco":
            return (0, int(self.grad_compression != "none"), int(self.sync == "flat"), 0)
        return (1, self.outer_steps, int(self.outer_overlap > 0), int(self.outer_compression != "none"))

    def label(self) -> str:
        if self.sync != "diloco":
            return self.sync + (f" ({self.grad_compression} gradients)" if self.grad_compression != "none" else "")
        overlap = f", overlap {self.outer_overlap}" if self.outer_overlap else ""
        return f"diloco H={self.outer_steps}{overlap} ({self.outer_compression if self.outer_compression != 'none' else 'fp32'})"

    def train_args(self) -> list[str]:
        """The ``geoshard train`` options that run this choice."""
        args = ["--sync", self.sync]
        if self.sync == "diloco":
            args += ["--outer-steps", str(self.outer_steps), "--outer-overlap", str(self.outer_overlap)]
            # the peer-to-peer transport, train's default, predicted by its calibrated model
            # (sim/p2p.py); said explicitly so that the run is what was predicted
            args += ["--outer-compression", self.outer_compression, "--outer-transport", "p2p"]
        elif self.grad_compression != "none":
            args += ["--grad-compression", self.grad_compression]
        return args

    def apply(self, cfg: SimConfig) -> SimConfig:
        if self.sync != "diloco":
            return replace(cfg, sync=self.sync, grad_compression=self.grad_compression)
        return replace(
            cfg,
            sync="diloco",
            grad_compression="none",
            outer_steps=self.outer_steps,
            outer_overlap=self.outer_overlap,
            outer_compression=self.outer_compression,
            outer_transport="p2p",
        )


def sync_grid(regions: int, steps: int, max_outer_steps: int) -> list[SyncChoice]:
    """Every sync choice worth predicting: one region needs no sync across regions."""
    if regions < 2:
        return [SyncChoice("flat")]
    out = [SyncChoice(s, c) for s in ("hierarchical", "flat") for c in GRAD_COMPRESSIONS]
    for h in (h for h in H_GRID if h <= max_outer_steps and h < steps):
        for overlap in (0, h // 2):
            out += [SyncChoice("diloco", outer_steps=h, outer_overlap=overlap, outer_compression=c) for c in OUTER_COMPRESSIONS]
    return out


@dataclass(frozen=True)
class Placement:
    """Where one region's ranks read: their own copy (``tier``), or ``data_region``'s bucket."""

    tier: str  # s3 (the region's own bucket) | local (a replica on its nodes) | alluxio | remote
    data_region: str | None = None  # remote: the region whose bucket holds this region's shards

    @property
    def rank(self) -> int:
        return len(TIERS) if self.tier == "remote" else TIERS.index(self.tier)

    def label(self) -> str:
        if self.tier == "remote":
            return f"reads {self.data_region}'s bucket"
        return {"s3": "own bucket", "local": "local replica", "alluxio": "own bucket behind Alluxio"}[self.tier]
