"""The report's DiLoCo part and the job's compute utilization.

- ``utilization``: compute time over wall time, summed over ranks, where compute excludes every
  gradient exchange (``comm_s``: DDP's all-reduce, inside the region or across) and everything
  outside ``compute_s`` (data wait, checkpoints, DiLoCo's outer rounds); against a target (95%
  by default, ``--utilization-target``).
- ``outer`` (``--sync diloco``): from each region leader's ``rounds-<region>.jsonl``
  (``diloco/loop.py``, read by ``diloco/record.py``): per outer round, which regions took part, the
  slowest region's sync time and the bytes the leaders moved through the outer store; per region,
  rounds taken part in, rounds missed (closed without it while it was still training) and steps lost;
  the values each region's leader refused from the store (``refused``: unsigned, malformed or
  non-finite) and each pseudo-gradient a round left out, with why (``left_out``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from geoshard.trainer.diloco.record import read_rounds

DEFAULT_TARGET = 0.95


def utilization(ranks: Iterable[Mapping[str, Any]], targets: Iterable[Any]) -> dict[str, Any]:
    ranks = list(ranks)
    wall = sum(r["wall_s"] for r in ranks)
    compute = sum(max(0.0, r["compute_s"] - r["comm_s"]) for r in ranks)
    target = min((t for t in targets if isinstance(t, int | float) and not isinstance(t, bool) and 0 < t <= 1), default=DEFAULT_TARGET)
    share = round(compute / wall, 6) if wall > 0 else 0.0
    return {"share": share, "compute_s": round(compute, 6), "wall_s": round(wall, 6), "target": target, "met": share >= target}


def _region_row() -> dict[str, Any]:
    return {"rounds": 0, "rounds_missed": 0, "adopted": 0, "joins": 0, "steps_lost": 0}


def outer_section(run_dir: str | Path) -> dict[str, Any] | None:
    """The ``outer`` part of the report; None for a run without DiLoCo rounds."""
    records = read_rounds(Path(run_dir)) if run_dir else []
    if not records:
        return None
    rounds: dict[tuple[str, int], dict[str, Any]] = {}
    regions: dict[str, dict[str, Any]] = {}
    refused: dict[str, int] = {}
    left_out: dict[tuple[str, int, str], str] = {}
    for rec in records:
        g = regions.setdefault(rec.region, _region_row())
        g["steps_lost"] += rec.steps_lost
        if rec.refused:
            refused[rec.region] = refused.get(rec.region, 0) + rec.refused
        for name, why in rec.left_out:  # every member's leader names it: once per round
            left_out.setdefault((str(rec.job), rec.round, name), why)
        if rec.event == "join":
            g["joins"] += 1
            continue
        r = rounds.setdefault(
            (str(rec.job), rec.round),
            {"round": rec.round, "regions": [], "missing": [], "sync_s": 0.0, "bytes": 0, "adopted_by": []},
        )
        r["bytes"] += rec.bytes_published + rec.bytes_read
        if rec.adopted:
            g["adopted"] += 1
            r["adopted_by"].append(rec.region)
            continue
        r["regions"] = list(rec.regions)
        r["missing"] = sorted(set(r["missing"]) | set(rec.missing))
        r["sync_s"] = max(r["sync_s"], round(rec.sync_s, 6))
    for r in rounds.values():
        for name in r["regions"]:
            if name in regions:
                regions[name]["rounds"] += 1
        for name in r["missing"]:
            regions.setdefault(name, _region_row())["rounds_missed"] += 1
    table = [rounds[k] for k in sorted(rounds, key=lambda k: (k[0], k[1]))]
    syncs = [r["sync_s"] for r in table]
    return {
        "rounds": table,
        "regions": dict(sorted(regions.items())),
        "round_count": len(table),
        "sync_s_mean": round(sum(syncs) / len(syncs), 6) if syncs else 0.0,
        "sync_s_max": max(syncs, default=0.0),
        "bytes": sum(r["bytes"] for r in table),
        # the pseudo-gradients' form on the long links (codec.py): one name, unless regions of
        # several launches of the job differ
        "compression": ", ".join(sorted({rec.compression for rec in records if rec.event != "join" and rec.compression})),
        "refused": dict(sorted(refused.items())),
        "left_out": [{"round": r, "region": g, "reason": why} for (_, r, g), why in sorted(left_out.items())],
    }
