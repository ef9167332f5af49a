"""``geoshard report RUN_DIR``: the IO-wait report of a training run, as tables or JSON."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from geoshard.cli.progress import UNCUT_WIDTH, stdout_console
from geoshard.loaders.stats import StatsSnapshot
from geoshard.trainer.report import DEFAULT_BUDGET, build_report, write_report
from geoshard.util.units import human_bytes


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--budget",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help=f"Largest acceptable share of training time spent waiting for data [default: the run's, else {DEFAULT_BUDGET}]. "
    "Another budget than the run's is a what-if: printed, and report.json is left as it is.",
)
@click.option("--fail-over-budget", is_flag=True, help="Exit 1 when the IO-wait share is over --budget (for CI).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def report(run_dir: Path, budget: float | None, fail_over_budget: bool, as_json: bool) -> None:
    """How much of the training run in RUN_DIR was spent waiting for data, against --budget.

    Writes RUN_DIR/report.json and RUN_DIR/report.png (data wait and compute per step, per rank),
    unless --budget differs from the budget the run's report.json was written with.
    """
    own = _run_budget(run_dir)
    budget = budget if budget is not None else own if own is not None else DEFAULT_BUDGET
    result = build_report(run_dir, budget)
    what_if = own is not None and budget != own
    if not what_if:
        json_path, png_path = write_report(run_dir, result)
    if as_json:
        click.echo(json.dumps(result, indent=1, allow_nan=False))
    else:
        stdout_console().print(Group(*_renderables(result)))
        if what_if:
            click.echo(f"what-if at budget {budget:.1%}: {run_dir / 'report.json'} left as written (budget {own:.1%})")
        else:
            click.echo(f"report: {json_path}   plot: {png_path}")
    if fail_over_budget and not result["within_budget"]:
        click.echo(
            f"geoshard: IO wait {result['io_wait_share']:.1%} of training time is over the {budget:.1%} budget (--fail-over-budget)",
            err=True,
        )
        sys.exit(1)


def _run_budget(run_dir: Path) -> float | None:
    """The budget the run's report.json was written with (by the trainer, or an earlier report)."""
    try:
        budget = json.loads((run_dir / "report.json").read_bytes()).get("budget")
    except (OSError, ValueError, AttributeError):
        return None
    return float(budget) if isinstance(budget, int | float) and 0 < budget < 1 else None


def render_report(result: Mapping[str, Any], *, width: int | None = None) -> str:
    """The report's tables as plain text (no colour), e.g. for a log at the end of training;
    ``width`` None: as wide as the tables need (nothing cut)."""
    console = Console(file=io.StringIO(), width=width or UNCUT_WIDTH, color_system=None, force_terminal=False)
    console.print(Group(*_renderables(result)))
    out = console.file
    assert isinstance(out, io.StringIO)
    return out.getvalue()


def _renderables(r: Mapping[str, Any]) -> list[RenderableType]:
    share, budget = r["io_wait_share"], r["budget"]
    ok = r["within_budget"]
    headline = Text.assemble(
        "IO wait: ",
        (f"{share:.1%}", "bold"),
        f" of training time, budget {budget:.1%}: ",
        (r["verdict"], "bold green" if ok else "bold red"),
    )
    out: list[RenderableType] = [
        headline,
        *_try(r, "io_wait"),
        _summary_lines(r),
        *_try(r, "utilization"),
        _breakdown_table(r),
        _ranks_table(r),
    ]
    if len(r.get("regions") or {}) > 1:
        out.append(_regions_table(r))
    if r.get("outer"):
        out += _outer_renderables(r)
    if r["tiers"]:
        out.append(_tiers_table(r))
    if r["egress_bytes"]:
        out.append(_egress_table(r))
    out += _try(r, "egress")
    if not r["complete"]:
        missing = [str(x["rank"]) for x in r["ranks"] if not x["finished"]]
        found = len(r["ranks"])
        note = f"incomplete run: {found} of {r['world_size']} ranks found"
        if missing:
            note += f"; rank(s) {', '.join(missing)} wrote no rank summary (still running or failed): wall time up to their last step"
        out.append(Text(note, style="yellow"))
    return out


def _try(r: Mapping[str, Any], verdict: str) -> list[RenderableType]:
    """The line under a verdict that is not met: what to try (reports of older versions have none)."""
    line = (r.get("advice") or {}).get(verdict)
    return [Text(f"  try: {line}", style="yellow", no_wrap=True, overflow="ignore")] if line else []  # one line, never folded


def _summary_lines(r: Mapping[str, Any]) -> Text:
    run = f"{r['world_size']} rank(s)" + (f" in {', '.join(r['regions'])}" if r["regions"] else "")
    run += f", {r['steps']:,} steps" + (f" ({r['step_first']}..{r['step_last']})" if r["step_first"] is not None else "")
    if r.get("segments", 1) > 1:
        run += f" in {r['segments']} segments (resumed or restarted; all of them counted)"
    run += f", {r['samples']:,} samples"
    if r["loss_first"] is not None and r["loss_last"] is not None:
        run += f", loss {r['loss_first']:.4g} → {r['loss_last']:.4g}"
    ttfb = r["time_to_first_batch_s"]
    start = f"first batch after {duration(ttfb)} (slowest rank), then " if ttfb is not None else "after the first batch: "
    start += f"IO wait {r['io_wait_share_after_first_batch']:.1%}"
    lines = f"{run}\n{start}"
    u = r.get("utilization")
    if u:
        verdict = "met" if u["met"] else "not met"
        lines += f"\ncompute utilization {u['share']:.1%} (compute without gradient exchange / wall), target {u['target']:.0%}: {verdict}"
        if not r.get("grad_sync_measured", True):
            lines += " (gradient sync not measured: counted as compute)"
        lines += _steady_line(r)
    return Text(lines)


def _steady_line(r: Mapping[str, Any]) -> str:
    """Start-up apart, then the steady state's utilization (report fields startup_s, utilization_steady)."""
    startup, steady = r.get("startup_s"), r.get("utilization_steady")
    if startup is None and not steady:
        return ""
    line = f"\nstart-up {duration(startup)} (until every rank took its first step)" if startup is not None else "\n"
    if steady:
        verdict = "met" if steady["met"] else "not met"
        line += "; " if startup is not None else ""
        line += (
            f"steady state {steady['share']:.1%} over steps {steady['step_from']:,}-{steady['step_to']:,} "
            f"(without {steady['excludes']}), target {steady['target']:.0%}: {verdict}"
        )
    return line


def _breakdown_table(r: Mapping[str, Any]) -> Table:
    b = r["breakdown"]
    table = Table(title="step time (all ranks)", title_justify="left")
    for col in ("", "time", "share"):
        table.add_column(col, justify="left" if not col else "right", no_wrap=True)
    rows = [
        ("data wait", "data_wait"),
        ("compute", "compute"),
        ("  of which gradient sync", "comm"),
        ("checkpoint", "checkpoint"),
        ("outer rounds (DiLoCo)", "outer_sync"),
        ("other", "other"),
    ]
    for label, key in rows:
        if key not in b or (key == "outer_sync" and not b[key]["seconds"]):  # older reports; runs without DiLoCo
            continue
        style = "red" if key == "data_wait" and not r["within_budget"] else "dim" if key == "comm" else None
        if key == "comm" and not r.get("grad_sync_measured", True):
            table.add_row(label, "not measured", "-", style=style)  # StepLog: the all-reduce is inside compute
            continue
        table.add_row(label, duration(b[key]["seconds"]), f"{b[key]['share']:.1%}", style=style)
    table.add_row("wall", duration(b["wall"]["seconds"]), "100.0%", style="bold")
    return table


def _ranks_table(r: Mapping[str, Any]) -> Table:
    table = Table(title="ranks", title_justify="left")
    gpu = any(x["gpu_util"] is not None for x in r["ranks"])  # CPU runs: no column of dashes
    for col in ("rank", "region", "wall", "data wait", "IO wait", "compute", "1st batch", *(("GPU",) if gpu else ())):
        # Region names are single words: fold rather than cut them when the terminal is narrow.
        table.add_column(col, justify="left" if col == "region" else "right", no_wrap=col != "region", overflow="fold")
    for x in r["ranks"]:
        over = x["io_wait_share"] > r["budget"]
        row: list[RenderableType] = [
            str(x["rank"]),
            x["region"] or "-",
            duration(x["wall_s"]),
            duration(x["data_wait_s"]),
            Text(f"{x['io_wait_share']:.1%}", style="red" if over else "green"),
            duration(x["compute_s"]),
            duration(x["time_to_first_batch_s"]) if x["time_to_first_batch_s"] is not None else "-",
        ]
        if gpu:
            row.append(f"{x['gpu_util']:.0%}" if x["gpu_util"] is not None else "-")
        table.add_row(*row)
    return table


def _regions_table(r: Mapping[str, Any]) -> Table:
    table = Table(title="regions", title_justify="left")
    for col in ("region", "ranks", "IO wait", "after 1st", "1st batch", "read", "per epoch", "left out", "repeated", "generation"):
        table.add_column(col, justify="left" if col == "region" else "right", no_wrap=True)
    for name, g in r["regions"].items():
        table.add_row(
            name,
            str(g["ranks"]),
            Text(f"{g['io_wait_share']:.1%}", style="red" if g["io_wait_share"] > r["budget"] else "green"),
            f"{g['io_wait_share_after_first_batch']:.1%}",
            duration(g["time_to_first_batch_s"]) if g["time_to_first_batch_s"] is not None else "-",
            human_bytes(sum(g["tier_bytes"].values())),
            _count(g["samples_per_epoch"]),
            _count(g["left_out_per_epoch"]),
            _count(g["repeated_per_epoch"]),
            _generation_runs(g.get("generations") or {}),
        )
    steps = f"{human_bytes(r['cross_region_grad_bytes_per_step'])} per step" if r.get("cross_region_grad_bytes_per_step") else "none"
    if r.get("grad_sync_measured", True):
        sync = f"gradient sync {r.get('sync') or '-'}: {duration(r['grad_sync_s_per_step'])} per step and rank" + (
            f", of which {duration(r['grad_sync_cross_s_per_step'])} between region leaders" if r.get("grad_sync_cross_s_per_step") else ""
        )
    else:
        sync = "gradient sync not measured (StepLog cannot see DDP's all-reduce)"
    table.caption = f"across regions: data {human_bytes(r['cross_region_data_bytes'])} (goal 0), gradients {steps}; {sync}"
    table.caption_justify = "left"
    return table


def _generation_runs(gens: Mapping[str, int]) -> str:
    """Epochs by generation: ``1 (epochs 0-2), 2 (3-4)``; one generation alone is its number."""
    runs: list[list[Any]] = []  # [generation, first epoch, last epoch]
    for epoch, gen in gens.items():
        if runs and runs[-1][0] == gen:
            runs[-1][2] = epoch
        else:
            runs.append([gen, epoch, epoch])
    if len(runs) <= 1:
        return str(runs[0][0]) if runs else "-"
    return ", ".join(f"{g} (epochs {a}-{b})" if a != b else f"{g} (epoch {a})" for g, a, b in runs)


MAX_ROUND_ROWS = 12


def _outer_renderables(r: Mapping[str, Any]) -> list[RenderableType]:
    """DiLoCo: the outer rounds (the last ones when there are many) and each region's losses."""
    o = r["outer"]
    table = Table(title="DiLoCo outer rounds", title_justify="left")
    for col in ("round", "regions", "missing", "sync (slowest)", "through the store"):
        table.add_column(col, justify="right" if col in ("round", "sync (slowest)", "through the store") else "left", no_wrap=True)
    rows = o["rounds"]
    for x in rows[-MAX_ROUND_ROWS:]:
        missing = ", ".join(x["missing"]) or "-"
        table.add_row(
            str(x["round"]),
            ", ".join(x["regions"]) or "-",
            Text(missing, style="yellow" if x["missing"] else ""),
            duration(x["sync_s"]),
            human_bytes(x["bytes"]),
        )
    earlier = len(rows) - MAX_ROUND_ROWS
    table.caption = (f"{earlier} earlier round(s) in report.json; " if earlier > 0 else "") + (
        f"{o['round_count']} round(s), sync {duration(o['sync_s_mean'])} on average, {duration(o['sync_s_max'])} at most, "
        f"{human_bytes(o['bytes'])} through the outer store" + (f" ({o['compression']} pseudo-gradients)" if o.get("compression") else "")
    )
    table.caption_justify = "left"
    regions = Table(title="DiLoCo per region", title_justify="left")
    for col in ("region", "rounds", "missed", "adopted", "starts", "steps lost"):
        regions.add_column(col, justify="left" if col == "region" else "right", no_wrap=True)
    for name, g in o["regions"].items():
        lost = g["steps_lost"] or g["rounds_missed"]
        regions.add_row(
            name,
            str(g["rounds"]),
            str(g["rounds_missed"]),
            str(g["adopted"]),
            str(g["joins"]),
            str(g["steps_lost"]),
            style="yellow" if lost else None,
        )
    out: list[RenderableType] = [table, regions]
    for x in o.get("left_out", [])[-MAX_ROUND_ROWS:]:
        out.append(Text(f"round {x['round']} left out {x['region']}'s pseudo-gradient: {x['reason']}", style="yellow"))
    if o.get("refused"):
        counts = ", ".join(f"{name} {n}" for name, n in o["refused"].items())
        out.append(Text(f"values refused from the outer store (unsigned, malformed or non-finite): {counts}", style="yellow"))
    return out


def _count(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "-"


def _tiers_table(r: Mapping[str, Any]) -> Table:
    # Short headers keep the table within 80 columns; the title says what avg and max are.
    table = Table(title="loader tiers (all ranks; fetch latency avg and max)", title_justify="left")
    for col in ("tier", "hits", "bytes", "misses", "errors", "corrupt", "avg", "max"):
        table.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    for name, t in r["tiers"].items():
        table.add_row(
            name,
            f"{t['hits']:,}",
            human_bytes(t["bytes"]),
            f"{t['misses']:,}",
            f"{t['errors']:,}",
            f"{t['verify_failures']:,}",
            duration(t["fetch_seconds_mean"]),
            duration(t["fetch_seconds_max"]),
        )
    caption = [f"{r['writebacks']:,} write-backs to the local replica"]
    if r["dropped_samples"]:
        n = r["dropped_samples"]
        caption.append(f"{n:,} sample{'s' if n != 1 else ''} left out per epoch (a different block each epoch)")
    table.caption = Text(", ".join(caption), no_wrap=True, overflow="ignore")  # one line, never folded
    table.caption_justify = "left"
    return table


def _egress_table(r: Mapping[str, Any]) -> Table:
    table = Table(title="cross-region egress", title_justify="left")
    table.add_column("from bucket")
    table.add_column("read in")
    table.add_column("bytes", justify="right")
    for pair, n in StatsSnapshot.from_dict(r, "the report").egress.items():
        table.add_row(pair.source, pair.reader, human_bytes(n))
    budget, most = r.get("egress_budget_bytes"), r.get("egress_bytes_max_rank", 0)
    if budget:
        note = f"budget {human_bytes(budget)} per rank (egress.budget): the most one rank read is {human_bytes(most)}, {most / budget:.0%}"
    else:
        note = "no egress budget in the plan (egress.budget): cross-region reads are not capped"
    table.caption, table.caption_justify = Text(note, no_wrap=True, overflow="ignore"), "left"
    return table


def duration(seconds: float) -> str:
    """Seconds as people read them: 850 ms, 12.3 s, 4m 05s, 2h 03m."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"
