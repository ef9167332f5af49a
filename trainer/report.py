"""The IO-wait report of a training run: the share of the training loop's wall time each rank
spent blocked on data, against a budget, with the step-time breakdown and the loader's counters.

It reads what the training loop writes into RUN_DIR:

- ``steps-rank{R}.jsonl``: one record per optimizer step of rank R (``step``, ``t`` seconds since
  the loop started at the end of the step, ``data_wait_s``, ``compute_s``, ``comm_s`` (gradient
  all-reduce, overlapping backward, so part of ``compute_s``), ``checkpoint_s``, ``step_s``,
  ``loss``, ``samples``);
- ``rank{R}.json``: the rank's summary written when its loop ends (``wall_s``,
  ``time_to_first_batch_s``, ``steps``, ``samples``, ``loader`` stats, ``gpu_util``, ...).

A rank without its summary (still running, or died) is reported from its steps: its wall time is
the end of its last step. A final line cut off mid-write is skipped for the same reason.

A resumed or restarted run has several segments (``segment`` in each step record, ``t`` counting
from the segment's start; ``earlier_segments`` in the rank summary): times, steps, samples and the
loader's counters cover all of them, so the breakdown adds up to the wall time of the whole run.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from geoshard.errors import ConfigError, DataError
from geoshard.trainer.outer_report import outer_section, utilization
from geoshard.trainer.record import StepRecord
from geoshard.util.fsutil import write_atomic

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 0.05
REPORT_JSON = "report.json"
REPORT_PNG = "report.png"

_STEPS_FILE = re.compile(r"^steps-rank(\d+)\.jsonl$")
_SUMMARY_FILE = re.compile(r"^rank(\d+)\.json$")
_TIER_SUMS = ("hits", "bytes", "misses", "errors", "verify_failures", "fetch_seconds")


@dataclass(frozen=True)
class RankRun:
    """What one rank left in RUN_DIR: its validated step records and its summary (None if absent)."""

    rank: int
    steps: tuple[StepRecord, ...]
    summary: dict[str, Any] | None


def check_budget(budget: float) -> float:
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < 1:
        raise ConfigError(f"budget must be a share between 0 and 1 (exclusive), e.g. 0.05 for 5%; got {budget!r}")
    return float(budget)


def read_run(run_dir: str | Path) -> dict[int, RankRun]:
    """Every rank's files in ``run_dir``, by rank. Raises DataError naming the file that is wrong."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ConfigError(f"{d}: no such run directory")
    steps_files: dict[int, Path] = {}
    summary_files: dict[int, Path] = {}
    for p in d.iterdir():
        if m := _STEPS_FILE.match(p.name):
            steps_files[int(m.group(1))] = p
        elif m := _SUMMARY_FILE.match(p.name):
            summary_files[int(m.group(1))] = p
    if not steps_files and not summary_files:
        raise DataError(f"{d}: no steps-rank*.jsonl or rank*.json files; is this the run directory of a geoshard training run?")
    runs = {}
    for rank in sorted(steps_files.keys() | summary_files.keys()):
        if rank not in steps_files:
            raise DataError(f"{d / f'steps-rank{rank}.jsonl'}: missing, but {summary_files[rank].name} is there")
        summary = _read_summary(summary_files[rank], rank) if rank in summary_files else None
        runs[rank] = RankRun(rank=rank, steps=tuple(_read_steps(steps_files[rank], rank)), summary=summary)
    return runs


def build_report(run_dir: str | Path, budget: float = DEFAULT_BUDGET) -> dict[str, Any]:
    """The report of the run in ``run_dir`` as a JSON-ready dict.

    ``io_wait_share`` (data wait over loop wall time, summed over ranks) against ``budget`` gives
    ``within_budget`` and ``verdict``; ``breakdown`` splits the wall time into the disjoint
    data_wait, compute, checkpoint, outer_sync (DiLoCo) and other (``comm`` is part of compute); ``ranks`` has the same
    per rank; ``tiers``, ``egress_bytes`` and ``writebacks`` sum the loader's stats;
    ``dropped_samples`` is what each epoch leaves out (per epoch, over the job; a different block
    every epoch, so no sample is lost for good). Shares are 0..1, times in seconds.
    """
    return summarize(read_run(run_dir), check_budget(budget), run_dir=str(run_dir))


def write_report(run_dir: str | Path, report: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write RUN_DIR/report.json and RUN_DIR/report.png atomically; return both paths."""
    from geoshard.trainer.plot import plot_steps

    d = Path(run_dir)
    json_path, png_path = d / REPORT_JSON, d / REPORT_PNG
    try:
        write_atomic(json_path, (json.dumps(report, indent=1, allow_nan=False) + "\n").encode())
        # The plot needs every step, which the report does not keep; read them again.
        steps = {rank: [s.to_json() for s in r.steps] for rank, r in read_run(d).items()}
        plot_steps(steps, png_path, budget=report.get("budget"), title=f"{d.name}: data wait and compute per step")
    except OSError as e:
        raise ConfigError(f"{d}: cannot write the report there ({e.strerror}); copy the run directory somewhere writable") from e
    return json_path, png_path


def summarize(runs: Mapping[int, RankRun], budget: float, run_dir: str = "") -> dict[str, Any]:
    if not runs:
        raise ValueError("summarize needs at least one rank")
    ranks = [_rank_summary(r) for r in runs.values()]
    wall = sum(r["wall_s"] for r in ranks)
    parts = {k: sum(r[f"{k}_s"] for r in ranks) for k in ("data_wait", "compute", "comm", "checkpoint", "outer_sync", "other")}
    share = _share(parts["data_wait"], wall)
    after = _share(*(sum(x) for x in zip(*(_after_first_batch(r) for r in runs.values()), strict=True)))
    summaries = [r.summary for r in runs.values() if r.summary is not None]
    world_size = max([len(runs), *(s["world_size"] for s in summaries if _is_int(s.get("world_size")))])
    region_names = sorted({r["region"] for r in ranks if r["region"]})
    first_batch = [r["time_to_first_batch_s"] for r in ranks if r["time_to_first_batch_s"] is not None]
    steps = [r.steps for r in runs.values() if r.steps]
    loader = _merge_loader(_all_summaries(summaries))
    loader["dropped_samples"] = _left_out_per_epoch(summaries)
    budgets = [s["egress_budget"] for s in summaries if _is_int(s.get("egress_budget"))]
    per_rank = [
        sum(n for x in _all_summaries([s]) for n in ((x.get("loader") or {}).get("egress_bytes") or {}).values()) for s in summaries
    ]
    return {
        "run_dir": run_dir,
        "io_wait_share": share,
        "io_wait_share_mean": _r(sum(r["io_wait_share"] for r in ranks) / len(ranks)),
        "io_wait_share_max": max(r["io_wait_share"] for r in ranks),
        "io_wait_share_after_first_batch": after,
        "budget": budget,
        "within_budget": share <= budget,
        "verdict": "within budget" if share <= budget else "over budget",
        "time_to_first_batch_s": max(first_batch) if first_batch else None,
        "steps": max(r["steps"] for r in ranks),
        "segments": max(r["segments"] for r in ranks),
        "step_first": min((s[0].step for s in steps), default=None),
        "step_last": max((s[-1].step for s in steps), default=None),
        "samples": sum(r["samples"] for r in ranks),
        "world_size": world_size,
        # Complete when every rank of the world wrote its summary; otherwise some wall times are estimates.
        "complete": len(summaries) == world_size,
        "region": region_names[0] if len(region_names) == 1 else None,
        "regions": _regions(runs, ranks),
        **_cross_region(runs, loader),
        "loss_first": _mean_loss(s[0] for s in steps),
        "loss_last": _mean_loss(s[-1] for s in steps),
        "breakdown": {
            "wall": {"seconds": _r(wall), "share": 1.0},
            **{k: {"seconds": _r(v), "share": _share(v, wall)} for k, v in parts.items()},
        },
        "ranks": ranks,
        # Compute (without any gradient exchange) over wall time, against --utilization-target.
        "utilization": utilization(ranks, (s.get("utilization_target") for s in summaries)),
        "outer": outer_section(run_dir),  # --sync diloco: per round and per region; None otherwise
        **loader,
        # Bytes per rank the plan allows from other regions' buckets (None: no cap), and the most one rank read.
        "egress_budget_bytes": min(budgets) if budgets else None,
        "egress_bytes_max_rank": max(per_rank, default=0),
    }


def _regions(runs: Mapping[int, RankRun], ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per region: its ranks, their IO wait, first batch, tier bytes and what an epoch leaves out."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({r["region"] for r in ranks if r["region"]}):
        members = [r for r in ranks if r["region"] == name]
        mine = [runs[r["rank"]] for r in members]
        summaries = [m.summary for m in mine if m.summary is not None]
        after = [sum(x) for x in zip(*(_after_first_batch(m) for m in mine), strict=True)]
        ttfb = [r["time_to_first_batch_s"] for r in members if r["time_to_first_batch_s"] is not None]
        tiers = _merge_loader(_all_summaries(summaries))["tiers"]
        first = summaries[0] if summaries else {}
        out[name] = {
            "ranks": len(members),
            "global_ranks": [r["rank"] for r in members],
            "io_wait_share": _share(sum(r["data_wait_s"] for r in members), sum(r["wall_s"] for r in members)),
            "io_wait_share_after_first_batch": _share(after[0], after[1]),
            "time_to_first_batch_s": max(ttfb) if ttfb else None,
            "tier_bytes": {t: c["bytes"] for t, c in tiers.items()},
            "samples": sum(r["samples"] for r in members),
            "region_samples": first.get("region_samples"),
            "samples_per_epoch": first.get("samples_per_epoch"),
            "left_out_per_epoch": first.get("left_out_per_epoch"),
            "repeated_per_epoch": first.get("repeated_per_epoch"),
            "generations": _generations(first),
        }
    return out


def _generations(summary: Mapping[str, Any]) -> dict[str, int]:
    """The generation each epoch of the region read, over the rank's segments (a resume, a restart)."""
    out: dict[str, int] = {}
    for seg in [*(summary.get("earlier_segments") or []), summary]:
        gens = seg.get("generations") if isinstance(seg, Mapping) else None
        if isinstance(gens, Mapping):
            out.update({str(e): g for e, g in gens.items() if _is_int(g)})
    return dict(sorted(out.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))


def _left_out_per_epoch(summaries: Iterable[Mapping[str, Any]]) -> int:
    """Samples an epoch leaves out, over the job. Each rank's loader reports its region's figure
    (per epoch, over the region's ranks), so it is taken once per region, not summed over ranks."""
    per_region: dict[Any, int] = {}
    for s in summaries:
        n = (s.get("loader") or {}).get("dropped_samples", 0)
        if _is_int(n):
            per_region[s.get("region")] = max(per_region.get(s.get("region"), 0), n)
    return sum(per_region.values())


def _cross_region(runs: Mapping[int, RankRun], loader: Mapping[str, Any]) -> dict[str, Any]:
    """What crossed regions: data the loaders read from other regions' buckets, and gradients."""
    steps = max((len(r.steps) for r in runs.values()), default=0)
    grad = sum(x.cross_region_grad_bytes for r in runs.values() for x in r.steps)
    summaries = [r.summary for r in runs.values() if r.summary is not None]
    syncs = sorted({s["sync"] for s in summaries if isinstance(s.get("sync"), str)})
    records = [x for r in runs.values() for x in r.steps]
    leaders = [x for x in records if x.comm_cross_s > 0]
    return {
        "sync": syncs[0] if len(syncs) == 1 else None,
        "cross_region_data_bytes": sum(loader["egress_bytes"].values()),
        "cross_region_grad_bytes": grad,
        "cross_region_grad_bytes_per_step": _r(grad / steps) if steps else 0.0,
        # Per step and rank: the sync as a whole; its hop between region leaders (leaders only).
        "grad_sync_s_per_step": _r(sum(x.comm_s for x in records) / len(records)) if records else 0.0,
        "grad_sync_cross_s_per_step": _r(sum(x.comm_cross_s for x in leaders) / len(leaders)) if leaders else 0.0,
        "grad_sync_intra_s_per_step": _r(sum(x.comm_intra_s for x in records) / len(records)) if records else 0.0,
    }


def _rank_summary(run: RankRun) -> dict[str, Any]:
    s = run.summary or {}
    steps = run.steps
    wait, compute, comm, checkpoint, outer = (
        sum(getattr(x, k) for x in steps) for k in ("data_wait_s", "compute_s", "comm_s", "checkpoint_s", "outer_sync_s")
    )
    wall = _wall(run)
    segments = _segments(run)
    first = _segment_summaries(run).get(min(segments, default=0), {})  # the run's start, not a resume's
    ttfb = first.get("time_to_first_batch_s")
    if not _is_number(ttfb):
        ttfb = steps[0].data_wait_s if steps else None
    gpu = s.get("gpu_util")
    return {
        "rank": run.rank,
        "region": s.get("region") if isinstance(s.get("region"), str) else None,
        "io_wait_share": _share(wait, wall),
        "wall_s": _r(wall),
        "data_wait_s": _r(wait),
        "compute_s": _r(compute),
        "comm_s": _r(comm),
        "checkpoint_s": _r(checkpoint),
        "outer_sync_s": _r(outer),
        # compute includes comm (the all-reduce overlaps backward), so only these four are disjoint.
        "other_s": _r(max(0.0, wall - wait - compute - checkpoint - outer)),
        # The step log holds every step the run kept (steps redone after a resume only once).
        "steps": len(steps) if steps or not _is_int(s.get("steps")) else s["steps"],
        "samples": sum(x.samples for x in steps) if steps or not _is_int(s.get("samples")) else s["samples"],
        "segments": max(1, len(segments)),
        "time_to_first_batch_s": _r(ttfb) if ttfb is not None else None,
        "gpu_util": gpu if _is_number(gpu) else None,
        "finished": run.summary is not None,
    }


def _after_first_batch(run: RankRun) -> tuple[float, float]:
    """(data wait, wall) of the rank after the first step of each segment: without startups and
    their cold first fetches."""
    walls = _segment_walls(run)
    wait = sum(x.data_wait_s for steps in _segments(run).values() for x in steps[1:])
    return wait, sum(walls[seg] - steps[0].t for seg, steps in _segments(run).items())


def _segments(run: RankRun) -> dict[int, list[StepRecord]]:
    """The rank's step records by segment (first run, then each resume or restart), in order."""
    out: dict[int, list[StepRecord]] = {}
    for x in run.steps:
        out.setdefault(x.segment, []).append(x)
    return dict(sorted(out.items()))


def _segment_summaries(run: RankRun) -> dict[int, Mapping[str, Any]]:
    """The rank's summaries by segment: the last one written, and the earlier ones it carries."""
    if run.summary is None:
        return {}
    last = max((x.segment for x in run.steps), default=0)
    out: dict[int, Mapping[str, Any]] = {}
    for s in [*(run.summary.get("earlier_segments") or []), run.summary]:
        if isinstance(s, dict):
            seg = s.get("segment", last)  # summaries of older versions: the run's only segment
            out[seg if _is_int(seg) else last] = s
    return out


def _segment_walls(run: RankRun) -> dict[int, float]:
    """Each segment's wall time: its summary's when the rank finished it, else its last step's end."""
    summaries = _segment_summaries(run)
    walls = {}
    for seg, steps in _segments(run).items():
        wall = summaries.get(seg, {}).get("wall_s")
        # Same clock for both, so a wall time shorter than the last step's end is rounding only.
        walls[seg] = max(float(wall), steps[-1].t) if _is_number(wall) else steps[-1].t
    return walls


def _wall(run: RankRun) -> float:
    """The loop's wall time over every segment of the run."""
    if not run.steps:
        wall = (run.summary or {}).get("wall_s")
        return float(wall) if _is_number(wall) else 0.0
    return sum(_segment_walls(run).values())


def _all_summaries(summaries: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rank summaries with the earlier segments each carries: loader counters of the whole run."""
    out: list[Mapping[str, Any]] = []
    for s in summaries:
        out += [e for e in s.get("earlier_segments") or [] if isinstance(e, dict)]
        out.append(s)
    return out


def _merge_loader(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    tiers: dict[str, dict[str, Any]] = {}
    egress: dict[str, int] = {}
    writebacks = dropped = 0
    for s in summaries:
        loader = s.get("loader") or {}
        for name, c in (loader.get("tiers") or {}).items():
            t = tiers.setdefault(name, {k: 0 for k in _TIER_SUMS} | {"fetch_seconds_max": 0.0})
            for k in _TIER_SUMS:
                t[k] += c.get(k, 0)
            t["fetch_seconds_max"] = max(t["fetch_seconds_max"], c.get("fetch_seconds_max", 0.0))
        for key, n in (loader.get("egress_bytes") or {}).items():
            egress[key] = egress.get(key, 0) + n
        writebacks += loader.get("writebacks", 0)
        dropped += loader.get("dropped_samples", 0)
    for t in tiers.values():
        t["fetch_seconds"] = _r(t["fetch_seconds"])
        t["fetch_seconds_mean"] = _r(t["fetch_seconds"] / t["hits"]) if t["hits"] else 0.0
    return {
        "tiers": dict(sorted(tiers.items())),
        "egress_bytes": dict(sorted(egress.items())),
        "writebacks": writebacks,
        "dropped_samples": dropped,
    }


def _read_steps(path: Path, rank: int) -> list[StepRecord]:
    records = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    if not line.endswith("\n"):  # the last line, cut off while being written
                        log.warning("%s:%d: skipping an incomplete last line", path, lineno)
                        break
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
                records.append(StepRecord.from_json(rec, f"{path}:{lineno}", rank))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from e
    return records


def _read_summary(path: Path, rank: int) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from e
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get("rank", rank) != rank:
        raise DataError(f"{path}: rank {data['rank']!r} in the file of rank {rank}")
    if "wall_s" in data and (not _is_number(data["wall_s"]) or data["wall_s"] < 0):
        raise DataError(f"{path}: wall_s must be a number of seconds >= 0, got {data['wall_s']!r}")
    if data.get("loader") is not None and not _is_loader_stats(data["loader"]):
        raise DataError(f"{path}: loader is not the loader's stats (tiers, egress_bytes, writebacks, dropped_samples)")
    return data


def _is_loader_stats(loader: Any) -> bool:
    if not isinstance(loader, dict):
        return False
    tiers, egress = loader.get("tiers", {}), loader.get("egress_bytes", {})
    return (
        isinstance(tiers, dict)
        and all(isinstance(c, dict) and all(_is_number(c.get(k, 0)) for k in (*_TIER_SUMS, "fetch_seconds_max")) for c in tiers.values())
        and isinstance(egress, dict)
        and all(_is_int(n) for n in egress.values())
        and all(_is_int(loader.get(k, 0)) for k in ("writebacks", "dropped_samples"))
    )


def _mean_loss(records: Iterable[StepRecord]) -> float | None:
    # Each rank logs its local loss; their mean is the global one. A diverged (NaN) loss has no JSON form.
    losses = [r.loss for r in records if r.loss is not None]
    if not losses or not all(math.isfinite(x) for x in losses):
        return None
    return _r(sum(losses) / len(losses))


def _share(part: float, whole: float) -> float:
    return _r(min(1.0, part / whole)) if whole > 0 else 0.0


def _r(x: float) -> float:
    return round(float(x), 6)


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)
