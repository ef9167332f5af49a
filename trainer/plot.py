"""The report's PNG: a panel per region (a rank without one has its own), with each step's data
wait, compute, gradient sync and DiLoCo's outer rounds apart (means over the region's ranks),
the data-wait share against the budget, and, for a run under the WAN rehearsal, the latency
heatmap of the matrix it ran under.

matplotlib's object API with the Agg canvas directly, so neither pyplot's global figure state nor
the process-wide backend is touched (the training process may use either).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geoshard.trainer.diloco.record import RoundRecord
from geoshard.trainer.record import StepRecord
from geoshard.util.fsutil import write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_BARS = 400  # per panel; longer runs are shown as means over groups of consecutive steps
MAX_PANELS = 16  # more subplots are unreadable; the panels waiting most are the interesting ones

_WAIT, _COMPUTE, _SYNC, _OUTER, _SHARE, _BUDGET = "#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#333333"
# Bar series: label, colour, the seconds of a step it stands for (disjoint, so they stack to the step).
_SERIES = (
    ("data wait", _WAIT, lambda r: r.data_wait_s),
    ("compute", _COMPUTE, lambda r: max(0.0, r.compute_s - r.comm_s)),
    ("gradient sync", _SYNC, lambda r: r.comm_s),
    ("outer rounds (DiLoCo)", _OUTER, lambda r: r.outer_sync_s),
)


@dataclass(frozen=True)
class Panel:
    """One subplot: a region's ranks (or one rank without a region) and its outer rounds' steps."""

    name: str
    ranks: tuple[int, ...]
    records: tuple[StepRecord, ...]
    rounds: tuple[int, ...] = ()


def plot_steps(steps_by_rank: Mapping[int, Sequence[StepRecord]], path: str | Path, **options: Any) -> Path:
    """Write the PNG of ``steps_figure(steps_by_rank, **options)`` to ``path`` (atomically)."""
    fig = steps_figure(steps_by_rank, **options)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    out = Path(path)
    write_atomic(out, buf.getvalue())
    return out


def steps_figure(
    steps_by_rank: Mapping[int, Sequence[StepRecord]],
    *,
    budget: float | None = None,
    title: str | None = None,
    regions: Mapping[int, str | None] | None = None,
    rounds: Sequence[RoundRecord] = (),
    latency_ms: Mapping[tuple[str, str], float] | None = None,
    max_panels: int = MAX_PANELS,
) -> Figure:
    """The figure: one panel per region of ``regions`` (rank -> region; else each record's own),
    stacked bars per step and the data-wait share on the right axis with ``budget`` dashed;
    ``rounds`` (DiLoCo's records) mark each region's outer rounds; ``latency_ms`` (one-way, per
    region pair) adds the heatmap. Beyond ``max_panels`` panels, those waiting most are shown."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = group_panels(steps_by_rank, regions or {}, rounds)
    shown = panels
    if len(panels) > max_panels:
        shown = sorted(panels, key=lambda p: -_wait_share(p.records))[:max_panels]
        shown = [p for p in panels if p in shown]
    heat = 1 if latency_ms else 0
    rows = max(len(shown), 1) + heat
    fig = Figure(figsize=(10, 1.0 + 2.2 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    heading = title or "data wait, compute and gradient sync per step"
    if len(shown) < len(panels):
        heading += f" ({len(shown)} of {len(panels)} panels: those waiting most)"
    fig.suptitle(heading, fontsize=11)
    grid = fig.add_gridspec(rows, 1)
    if shown:
        series = [s for s in _SERIES if any(s[2](r) > 0 for p in shown for r in p.records) or s[0] in ("data wait", "compute")]
        axes = [fig.add_subplot(grid[i, 0]) for i in range(len(shown))]
        for i, (ax, panel) in enumerate(zip(axes, shown, strict=True)):
            _panel_axes(ax, panel, series, budget, legend=i == 0)
        axes[-1].set_xlabel("step")
    else:
        ax = fig.add_subplot(grid[0, 0])
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center")
        ax.set_axis_off()
    if latency_ms:
        _heatmap(fig.add_subplot(grid[rows - 1, 0]), latency_ms, [p.name for p in panels])
    return fig


def group_panels(
    steps_by_rank: Mapping[int, Sequence[StepRecord]], regions: Mapping[int, str | None], rounds: Sequence[RoundRecord] = ()
) -> list[Panel]:
    """A panel per region, in order of its first rank; a rank without a region is a panel of its own."""
    members: dict[str, list[int]] = {}
    for rank in sorted(steps_by_rank):
        records = steps_by_rank[rank]
        region = regions.get(rank) or next((r.region for r in records if r.region), None)
        members.setdefault(region or f"rank {rank}", []).append(rank)
    marks: dict[str, set[int]] = {}
    for rec in rounds:
        if rec.event == "round":  # adopted or not: where the region's training met the round
            marks.setdefault(rec.region, set()).add(rec.step)
    return [
        Panel(name, tuple(ranks), tuple(r for rank in ranks for r in steps_by_rank[rank]), tuple(sorted(marks.get(name, ()))))
        for name, ranks in members.items()
    ]


def _panel_axes(ax: Any, panel: Panel, series: Sequence[Any], budget: float | None, legend: bool) -> None:
    x, heights, share, per_bar = _bars(panel.records, series)
    ranks = ", ".join(str(r) for r in panel.ranks)
    steps = len({r.step for r in panel.records})
    label = f"{panel.name}: rank{'s' if len(panel.ranks) > 1 else ''} {ranks}, {steps} steps"
    if len(panel.ranks) > 1:
        label += " (means over its ranks)"
    if per_bar > 1:
        label += f", bars are means of {per_bar} steps"
    ax.set_title(label, fontsize=9, loc="left")
    if not panel.records:
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    # Gaps between hundreds of thin bars alias into stripes; touching bars read as an area.
    width = per_bar * (0.8 if len(x) < 100 else 1.0)
    bottom = [0.0] * len(x)
    for (name, colour, _), h in zip(series, heights, strict=True):
        ax.bar(x, h, width=width, bottom=bottom, color=colour, linewidth=0, label=name)
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    for i, step in enumerate(panel.rounds):
        ax.axvline(step, color=_OUTER, ls=":", lw=1, label="outer round" if i == 0 else None)
    ax.set_ylabel("s / step")
    ax.set_ylim(0, max(bottom, default=0.0) * 1.5 or 1.0)  # room for the legend above the bars
    right = ax.twinx()
    right.plot(x, share, color=_SHARE, lw=1.2, marker="." if len(x) < 50 else None, label="data-wait share")
    top = max([*share, budget or 0.0]) * 1.5
    if budget is not None:
        right.axhline(budget, color=_BUDGET, ls="--", lw=1, label=f"budget {budget:.0%}")
    right.set_ylim(0, min(1.0, top) if top > 0 else 1.0)
    right.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    right.set_ylabel("data-wait share")
    if legend or panel.rounds:  # each DiLoCo panel names its rounds' marks
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper right", fontsize=8, ncols=min(len(handles), 4))


def _bars(records: Sequence[StepRecord], series: Sequence[Any]) -> tuple[list[float], list[list[float]], list[float], int]:
    """Bar positions, each series' heights (means over the ranks and the grouped steps) and the
    data-wait share, grouping consecutive steps so a panel has at most MAX_BARS bars."""
    by_step: dict[int, list[StepRecord]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    steps = sorted(by_step)
    per_bar = max(1, math.ceil(len(steps) / MAX_BARS))
    x: list[float] = []
    heights: list[list[float]] = [[] for _ in series]
    share: list[float] = []
    for i in range(0, len(steps), per_bar):
        group = [r for step in steps[i : i + per_bar] for r in by_step[step]]
        n = len(group)
        x.append(sum(steps[i : i + per_bar]) / len(steps[i : i + per_bar]))
        for h, (_, _, seconds) in zip(heights, series, strict=True):
            h.append(sum(seconds(r) for r in group) / n)
        share.append(_wait_share(group))
    return x, heights, share, per_bar


def _heatmap(ax: Any, latency_ms: Mapping[tuple[str, str], float], order: Sequence[str]) -> None:
    """One-way latency between each pair of the run's regions (those of the matrix when the panels name none)."""
    names = [n for n in order if any(n in pair for pair in latency_ms)] or sorted({n for pair in latency_ms for n in pair})
    grid = [[latency_ms.get((a, b), latency_ms.get((b, a), 0.0)) if a != b else 0.0 for b in names] for a in names]
    image = ax.imshow(grid, cmap="Oranges", aspect="auto")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    top = max((v for row in grid for v in row), default=0.0)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            text = f"{v:g} ms" if i != j else "-"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if v > top / 2 else "black")
    ax.set_title("WAN rehearsal: one-way latency between regions (ms)", fontsize=9, loc="left")
    ax.figure.colorbar(image, ax=ax, label="ms")


def _wait_share(records: Sequence[StepRecord]) -> float:
    return _ratio(sum(r.data_wait_s for r in records), sum(r.step_s for r in records))


def _ratio(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0
