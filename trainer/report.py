"""The IO-wait report of a training run: the share of the training loop's wall time each rank
spent blocked on data, against a budget, with the step-time breakdown and the loader's counters.

It reads what the training loop writes into RUN_DIR (``rundir.read_run``: the step records and
rank summaries). A rank without its summary (still running, or died) is reported from its steps.
A resumed or restarted run has several segments: times, steps, samples and the loader's counters
cover all of them, so the breakdown adds up to the wall time of the whole run.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError, GeoshardError
from geoshard.loaders.stats import StatsSnapshot, merge
from geoshard.trainer.diloco.record import read_rounds
from geoshard.trainer.diloco.report import outer_section, utilization
from geoshard.trainer.record import StepRecord
from geoshard.trainer.report_advice import advise
from geoshard.trainer.rundir import (
    RankRun,
    after_first_batch,
    all_summaries,
    read_run,
    segment_summaries,
    segments,
    wall,
)
from geoshard.trainer.steady import startup_s, steady_utilization
from geoshard.trainer.summary import RankSummary
from geoshard.util.fsutil import write_atomic

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 0.05
REPORT_JSON = "report.json"
REPORT_PNG = "report.png"


def check_budget(budget: float) -> float:
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < 1:
        raise ConfigError(f"budget must be a share between 0 and 1 (exclusive), e.g. 0.05 for 5%; got {budget!r}")
    return float(budget)


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
        steps = {rank: r.steps for rank, r in read_run(d).items()}
        plot_steps(
            steps,
            png_path,
            budget=report.get("budget"),
            title=f"{d.name}: data wait, compute and gradient sync per step, per region",
            regions={x["rank"]: x["region"] for x in report.get("ranks", ())},
            rounds=read_rounds(d),
            latency_ms=wan_latency(d),
        )
    except OSError as e:
        raise ConfigError(f"{d}: cannot write the report there ({e.strerror}); copy the run directory somewhere writable") from e
    return json_path, png_path


def wan_latency(run_dir: Path) -> dict[tuple[str, str], float] | None:
    """One-way latency per region pair of the matrix a run under the WAN rehearsal ran under
    (RUN_DIR/wan.json names it); None for a run without it, or when the matrix is gone."""
    from geoshard.wan.matrix import load_matrix

    try:
        matrix = load_matrix(json.loads((run_dir / "wan.json").read_text())["matrix"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, GeoshardError) as e:
        log.warning("%s: no latency heatmap in the plot (%s)", run_dir / "wan.json", e)
        return None
    return {(link.a, link.b): link.latency_ms for link in matrix.links}


def summarize(runs: Mapping[int, RankRun], budget: float, run_dir: str = "") -> dict[str, Any]:
    if not runs:
        raise ValueError("summarize needs at least one rank")
    ranks = [_rank_summary(r) for r in runs.values()]
    wall = sum(r["wall_s"] for r in ranks)
    parts = {k: sum(r[f"{k}_s"] for r in ranks) for k in ("data_wait", "compute", "comm", "checkpoint", "outer_sync", "other")}
    share = _share(parts["data_wait"], wall)
    after = _share(*(sum(x) for x in zip(*(after_first_batch(r) for r in runs.values()), strict=True)))
    summaries = [r.summary for r in runs.values() if r.summary is not None]
    world_size = max([len(runs), *(s.world_size for s in summaries if s.world_size is not None)])
    region_names = sorted({r["region"] for r in ranks if r["region"]})
    first_batch = [r["time_to_first_batch_s"] for r in ranks if r["time_to_first_batch_s"] is not None]
    steps = [r.steps for r in runs.values() if r.steps]
    loader = _loader_fields(_merged(all_summaries(summaries)))
    loader["dropped_samples"] = _left_out_per_epoch(summaries)
    budgets = [s.egress_budget for s in summaries if s.egress_budget is not None]
    per_rank = [_merged(all_summaries([s])).egress_total for s in summaries]
    out = {
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
        "utilization": utilization(ranks, (s.utilization_target for s in summaries)),
        "outer": outer_section(run_dir),  # --sync diloco: per round and per region; None otherwise
        **_startup_and_steady(runs, summaries, run_dir),
        **loader,
        # Bytes per rank the plan allows from other regions' buckets (None: no cap), and the most one rank read.
        "egress_budget_bytes": min(budgets) if budgets else None,
        "egress_bytes_max_rank": max(per_rank, default=0),
    }
    out["advice"] = advise(out)  # per verdict not met: what to try (None when met)
    return out


def _startup_and_steady(runs: Mapping[int, RankRun], summaries: list[RankSummary], run_dir: str) -> dict[str, Any]:
    """Start-up (until every rank took its first step) and the steady state's utilization (steady.py)."""
    target = utilization([], (s.utilization_target for s in summaries))["target"]
    syncs = {s.sync for s in summaries if s.sync is not None}
    sync = syncs.pop() if len(syncs) == 1 else None
    rounds = read_rounds(Path(run_dir)) if run_dir and sync == "diloco" else []
    return {"startup_s": startup_s(runs), "utilization_steady": steady_utilization(runs, rounds, target, sync)}


def _regions(runs: Mapping[int, RankRun], ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per region: its ranks, their IO wait, first batch, tier bytes and what an epoch leaves out."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({r["region"] for r in ranks if r["region"]}):
        members = [r for r in ranks if r["region"] == name]
        mine = [runs[r["rank"]] for r in members]
        summaries = [m.summary for m in mine if m.summary is not None]
        after = [sum(x) for x in zip(*(after_first_batch(m) for m in mine), strict=True)]
        ttfb = [r["time_to_first_batch_s"] for r in members if r["time_to_first_batch_s"] is not None]
        tiers = _merged(all_summaries(summaries)).tiers
        first = summaries[0] if summaries else RankSummary(rank=-1)
        loaders = [s.loader for s in summaries if s.loader is not None]
        out[name] = {
            "ranks": len(members),
            "global_ranks": [r["rank"] for r in members],
            "io_wait_share": _share(sum(r["data_wait_s"] for r in members), sum(r["wall_s"] for r in members)),
            "io_wait_share_after_first_batch": _share(after[0], after[1]),
            "time_to_first_batch_s": max(ttfb) if ttfb else None,
            "tier_bytes": {t: tiers[t].bytes for t in sorted(tiers)},
            "samples": sum(r["samples"] for r in members),
            "region_samples": first.region_samples,
            "samples_per_epoch": first.samples_per_epoch,
            # StepLog's summary has only the loader's figures (per epoch, over the region's ranks).
            "left_out_per_epoch": _or_loader(first.left_out_per_epoch, [x.dropped_samples for x in loaders]),
            "repeated_per_epoch": _or_loader(first.repeated_per_epoch, [x.padded_samples for x in loaders]),
            "generations": _generations(first),
        }
    return out


def _or_loader(own: int | None, loader: list[int]) -> int | None:
    return own if own is not None else max(loader, default=None)


def _generations(summary: RankSummary) -> dict[str, int]:
    """The generation each epoch of the region read, over the rank's segments (a resume, a restart)."""
    out: dict[str, int] = {}
    for seg in [*(summary.earlier_segments or ()), summary]:
        out.update(seg.generations or {})
    return dict(sorted(out.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))


def _left_out_per_epoch(summaries: Iterable[RankSummary]) -> int:
    """Samples an epoch leaves out, over the job. Each rank's loader reports its region's figure
    (per epoch, over the region's ranks), so it is taken once per region, not summed over ranks."""
    per_region: dict[Any, int] = {}
    for s in summaries:
        n = s.loader.dropped_samples if s.loader is not None else 0
        per_region[s.region] = max(per_region.get(s.region, 0), n)
    return sum(per_region.values())


def _cross_region(runs: Mapping[int, RankRun], loader: Mapping[str, Any]) -> dict[str, Any]:
    """What crossed regions: data the loaders read from other regions' buckets, and gradients."""
    steps = max((len(r.steps) for r in runs.values()), default=0)
    grad = sum(x.cross_region_grad_bytes for r in runs.values() for x in r.steps)
    summaries = [r.summary for r in runs.values() if r.summary is not None]
    syncs = sorted({s.sync for s in summaries if s.sync is not None})
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
        # StepLog (an own loop) cannot see DDP's all-reduce: its comm_s is 0 and its summary names no sync.
        "grad_sync_measured": any(s.sync is not None for s in summaries) or any(x.comm_s > 0 for x in records),
    }


def _rank_summary(run: RankRun) -> dict[str, Any]:
    s = run.summary or RankSummary(rank=run.rank)
    steps = run.steps
    wait, compute, comm, checkpoint, outer = (
        sum(getattr(x, k) for x in steps) for k in ("data_wait_s", "compute_s", "comm_s", "checkpoint_s", "outer_sync_s")
    )
    total = wall(run)
    first = segment_summaries(run).get(min(segments(run), default=0))  # the run's start, not a resume's
    ttfb = first.time_to_first_batch_s if first is not None else None
    if ttfb is None:
        ttfb = steps[0].data_wait_s if steps else None
    return {
        "rank": run.rank,
        "region": s.region,
        "io_wait_share": _share(wait, total),
        "wall_s": _r(total),
        "data_wait_s": _r(wait),
        "compute_s": _r(compute),
        "comm_s": _r(comm),
        "checkpoint_s": _r(checkpoint),
        "outer_sync_s": _r(outer),
        # compute includes comm (the all-reduce overlaps backward), so only these four are disjoint.
        "other_s": _r(max(0.0, total - wait - compute - checkpoint - outer)),
        # The step log holds every step the run kept (steps redone after a resume only once).
        "steps": len(steps) if steps or s.steps is None else s.steps,
        "samples": sum(x.samples for x in steps) if steps or s.samples is None else s.samples,
        "segments": max(1, len(segments(run))),
        "time_to_first_batch_s": _r(ttfb) if ttfb is not None else None,
        "gpu_util": s.gpu_util,
        "finished": run.summary is not None,
    }


def _merged(summaries: Iterable[RankSummary]) -> StatsSnapshot:
    return merge(s.loader.stats for s in summaries if s.loader is not None)


def _loader_fields(stats: StatsSnapshot) -> dict[str, Any]:
    """report.json's loader fields: the merged counters in their wire form, latencies rounded."""
    wire = stats.to_dict()
    tiers = {}
    for name, t in sorted(wire["tiers"].items()):
        seconds = _r(t["fetch_seconds"])
        tiers[name] = {**t, "fetch_seconds": seconds, "fetch_seconds_mean": _r(seconds / t["hits"]) if t["hits"] else 0.0}
    return {"tiers": tiers, "egress_bytes": dict(sorted(wire["egress_bytes"].items())), "writebacks": wire["writebacks"]}


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
