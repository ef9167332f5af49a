"""The report's DiLoCo part and the job's compute utilization.

- ``utilization``: compute time over wall time, summed over ranks, where compute excludes every
  gradient exchange (``comm_s``: DDP's all-reduce, inside the region or across) and everything
  outside ``compute_s`` (data wait, checkpoints, DiLoCo's outer rounds); against a target (95%
  by default, ``--utilization-target``).
- ``outer`` (``--sync diloco``): from each region leader's ``rounds-<region>.jsonl``
  (trainer/outer.py): per outer round, which regions took part, the slowest region's sync time
  and the bytes the leaders moved through the outer store; per region, rounds taken part in,
  rounds missed (closed without it while it was still training) and steps lost.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from geoshard.errors import DataError

_ROUNDS_FILE = re.compile(r"^rounds-([a-z0-9][a-z0-9-]*)\.jsonl$")
DEFAULT_TARGET = 0.95


def utilization(ranks: Iterable[Mapping[str, Any]], targets: Iterable[Any]) -> dict[str, Any]:
    ranks = list(ranks)
    wall = sum(r["wall_s"] for r in ranks)
    compute = sum(max(0.0, r["compute_s"] - r["comm_s"]) for r in ranks)
    target = min((t for t in targets if isinstance(t, int | float) and not isinstance(t, bool) and 0 < t <= 1), default=DEFAULT_TARGET)
    share = round(compute / wall, 6) if wall > 0 else 0.0
    return {"share": share, "compute_s": round(compute, 6), "wall_s": round(wall, 6), "target": target, "met": share >= target}


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of every region's rounds file; DataError naming file and line when one is wrong.
    A last line cut off mid-write (a killed leader) is skipped."""
    out: list[dict[str, Any]] = []
    for path in sorted(p for p in run_dir.glob("rounds-*.jsonl") if _ROUNDS_FILE.match(p.name)):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for lineno, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                if lineno == len(lines):
                    continue
                raise DataError(f"{path}:{lineno}: not a JSON record") from None
            if not isinstance(rec, dict) or rec.get("event") not in ("join", "round") or not isinstance(rec.get("region"), str):
                raise DataError(f"{path}:{lineno}: expected a join or round record with its region")
            for key in ("round", "step", "steps_lost"):
                if not isinstance(rec.get(key, 0), int) or rec.get(key, 0) < 0:
                    raise DataError(f"{path}:{lineno}: {key} must be an integer >= 0, got {rec.get(key)!r}")
            out.append(rec)
    return out


def outer_section(run_dir: str | Path) -> dict[str, Any] | None:
    """The ``outer`` part of the report; None for a run without DiLoCo rounds."""
    records = read_rounds(Path(run_dir)) if run_dir else []
    if not records:
        return None
    rounds: dict[tuple[str, int], dict[str, Any]] = {}
    regions: dict[str, dict[str, Any]] = {}
    for rec in records:
        g = regions.setdefault(rec["region"], {"rounds": 0, "rounds_missed": 0, "adopted": 0, "joins": 0, "steps_lost": 0})
        g["steps_lost"] += rec.get("steps_lost", 0)
        if rec["event"] == "join":
            g["joins"] += 1
            continue
        key = (str(rec.get("job")), rec["round"])
        r = rounds.setdefault(
            key,
            {"round": rec["round"], "regions": [], "missing": [], "sync_s": 0.0, "bytes": 0, "adopted_by": []},
        )
        r["bytes"] += int(rec.get("bytes_published", 0)) + int(rec.get("bytes_read", 0))
        if rec.get("adopted"):
            g["adopted"] += 1
            r["adopted_by"].append(rec["region"])
            continue
        r["regions"] = list(rec.get("regions") or [])
        r["missing"] = sorted(set(r["missing"]) | set(rec.get("missing") or []))
        with contextlib.suppress(TypeError, ValueError):
            r["sync_s"] = max(r["sync_s"], round(float(rec.get("sync_s", 0.0)), 6))
    for r in rounds.values():
        for name in r["regions"]:
            if name in regions:
                regions[name]["rounds"] += 1
        for name in r["missing"]:
            regions.setdefault(name, {"rounds": 0, "rounds_missed": 0, "adopted": 0, "joins": 0, "steps_lost": 0})["rounds_missed"] += 1
    table = [rounds[k] for k in sorted(rounds, key=lambda k: (k[0], k[1]))]
    syncs = [r["sync_s"] for r in table]
    return {
        "rounds": table,
        "regions": dict(sorted(regions.items())),
        "round_count": len(table),
        "sync_s_mean": round(sum(syncs) / len(syncs), 6) if syncs else 0.0,
        "sync_s_max": max(syncs, default=0.0),
        "bytes": sum(r["bytes"] for r in table),
    }
