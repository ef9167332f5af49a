"""Samples per rank for a whole job: every rank of a DDP job must yield the same number per epoch,
although hash routing gives each region only about its weight's share and a job may run with other
rank counts than the plan's weights.

With ``remainder="drop"`` each rank yields the minimum over regions of region samples / region
ranks, and each region leaves the rest out of the epoch (a different block each epoch, see
``epoch.py``); with ``"pad"`` the maximum, and the other regions repeat samples to fill up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from geoshard.errors import ConfigError

Remainder = Literal["drop", "pad"]  # what an epoch does with samples that do not split evenly
WEIGHT_TOLERANCE = 0.10  # ranks per region vs plan weights: beyond this, a warning at start


@dataclass(frozen=True)
class RegionBalance:
    region: str
    samples: int  # the region's samples
    ranks: int
    samples_per_epoch: int  # what the region's ranks read in one epoch
    left_out: int  # per epoch (drop)
    repeated: int  # per epoch (pad)


@dataclass(frozen=True)
class Balance:
    samples_per_rank: int
    remainder: Remainder
    regions: tuple[RegionBalance, ...]

    def region(self, name: str) -> RegionBalance:
        for r in self.regions:
            if r.region == name:
                return r
        raise KeyError(name)

    def line(self) -> str:
        """The one start-up line: what each epoch leaves out or repeats, per region."""
        parts = []
        for r in self.regions:
            what = f"{r.left_out} left out" if self.remainder == "drop" else f"{r.repeated} repeated"
            parts.append(f"{r.region} {r.samples_per_epoch} of {r.samples} ({what})")
        return f"{self.samples_per_rank} samples per rank and epoch; per epoch " + "; ".join(parts)

    def weight_warnings(self, weights: Mapping[str, float]) -> list[str]:
        """Regions whose share of the job's ranks is more than 10% off their share of the plan's weight."""
        present = {r.region: r.ranks for r in self.regions}
        wsum = sum(weights[r] for r in present if r in weights)
        nsum = sum(present.values())
        out = []
        for name, ranks in present.items():
            if name not in weights or wsum <= 0:
                continue
            want, have = weights[name] / wsum, ranks / nsum
            if abs(have - want) > WEIGHT_TOLERANCE * want:
                out.append(
                    f"{name} has {ranks} of {nsum} ranks ({have:.0%}) but {want:.0%} of the plan's weight: "
                    f"an epoch {'leaves out' if self.remainder == 'drop' else 'repeats'} more of some region's samples"
                )
        return out


def check_remainder(remainder: str) -> None:
    if remainder not in ("drop", "pad"):
        raise ConfigError(f"remainder must be 'drop' or 'pad', got {remainder!r}")


def even_share(samples: int, ranks: int, remainder: Remainder) -> int:
    """Samples per rank when ``ranks`` ranks split ``samples``: rounded down with ``drop``, up with ``pad``."""
    return samples // ranks if remainder == "drop" else -(-samples // ranks)


def balance(samples: Mapping[str, int], ranks: Mapping[str, int], remainder: Remainder = "drop") -> Balance:
    """The job-wide samples per rank from each region's sample count and rank count."""
    check_remainder(remainder)
    if not ranks:
        raise ConfigError("a job needs at least one region with at least one rank")
    for name, n in ranks.items():
        if n < 1:
            raise ConfigError(f"region {name} has {n} ranks; every region of the job needs at least one")
        if name not in samples:
            raise ConfigError(f"no sample count for region {name}")
    per_region = {name: even_share(samples[name], n, remainder) for name, n in ranks.items()}
    per = min(per_region.values()) if remainder == "drop" else max(per_region.values())
    regions = []
    for name, n in ranks.items():
        k = per * n
        regions.append(RegionBalance(name, samples[name], n, k, max(0, samples[name] - k), max(0, k - samples[name])))
    return Balance(per, remainder, tuple(regions))
