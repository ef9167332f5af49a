"""The report's PNG: per rank, data wait stacked on compute for every step, and the data-wait share.

matplotlib's object API with the Agg canvas directly, so neither pyplot's global figure state nor
the process-wide backend is touched (the training process may use either).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from geoshard.trainer.record import StepRecord
from geoshard.util.fsutil import write_atomic

MAX_BARS = 400  # per rank; longer runs are shown as means over groups of consecutive steps
MAX_RANKS = 16  # more subplots are unreadable; the ranks waiting most are the interesting ones

_WAIT, _COMPUTE, _SHARE, _BUDGET = "#d62728", "#1f77b4", "#2ca02c", "#333333"


def plot_steps(
    steps_by_rank: Mapping[int, Sequence[StepRecord]],
    path: str | Path,
    *,
    budget: float | None = None,
    title: str | None = None,
    max_ranks: int = MAX_RANKS,
) -> Path:
    """Write a PNG with one subplot per rank: data wait and compute seconds per step (stacked bars)
    and, on the right axis, the step's data-wait share with ``budget`` as a dashed line.

    ``steps_by_rank`` maps a rank to its step records. Beyond ``max_ranks`` ranks, those with the highest data-wait share are shown.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ranks = sorted(steps_by_rank)
    shown = ranks
    if len(ranks) > max_ranks:
        shown = sorted(sorted(ranks, key=lambda r: -_wait_share(steps_by_rank[r]))[:max_ranks])
    fig = Figure(figsize=(10, 1.0 + 2.2 * max(len(shown), 1)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    heading = title or "data wait and compute per step"
    if len(shown) < len(ranks):
        heading += f" ({len(shown)} of {len(ranks)} ranks: those waiting most)"
    fig.suptitle(heading, fontsize=11)
    if shown:
        axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
        for i, (ax, rank) in enumerate(zip(axes, shown, strict=True)):
            _rank_axes(ax, rank, steps_by_rank[rank], budget, legend=i == 0)
        axes[-1].set_xlabel("step")
    else:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center")
        ax.set_axis_off()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    out = Path(path)
    write_atomic(out, buf.getvalue())
    return out


def _rank_axes(ax: Any, rank: int, records: Sequence[StepRecord], budget: float | None, legend: bool) -> None:
    x, wait, compute, share, per_bar = _bars(records)
    label = f"rank {rank}: {len(records)} steps"
    if per_bar > 1:
        label += f", bars are means of {per_bar} steps"
    ax.set_title(label, fontsize=9, loc="left")
    if not records:
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    # Gaps between hundreds of thin bars alias into stripes; touching bars read as an area.
    width = per_bar * (0.8 if len(x) < 100 else 1.0)
    ax.bar(x, wait, width=width, color=_WAIT, linewidth=0, label="data wait")
    ax.bar(x, compute, width=width, bottom=wait, color=_COMPUTE, linewidth=0, label="compute")
    ax.set_ylabel("s / step")
    right = ax.twinx()
    right.plot(x, share, color=_SHARE, lw=1.2, marker="." if len(x) < 50 else None, label="data-wait share")
    top = max([*share, budget or 0.0]) * 1.25
    if budget is not None:
        right.axhline(budget, color=_BUDGET, ls="--", lw=1, label=f"budget {budget:.0%}")
    right.set_ylim(0, min(1.0, top) if top > 0 else 1.0)
    right.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    right.set_ylabel("data-wait share")
    if legend:
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper right", fontsize=8, ncols=len(handles))


def _bars(records: Sequence[StepRecord]) -> tuple[list[float], list[float], list[float], list[float], int]:
    """Bar positions and heights, grouping consecutive steps so a rank has at most MAX_BARS bars."""
    per_bar = max(1, math.ceil(len(records) / MAX_BARS))
    x, wait, compute, share = [], [], [], []
    for i in range(0, len(records), per_bar):
        group = records[i : i + per_bar]
        n = len(group)
        w = sum(r.data_wait_s for r in group)
        x.append(sum(r.step for r in group) / n)
        wait.append(w / n)
        compute.append(sum(r.compute_s for r in group) / n)
        share.append(_ratio(w, sum(r.step_s for r in group)))
    return x, wait, compute, share, per_bar


def _wait_share(records: Sequence[StepRecord]) -> float:
    return _ratio(sum(r.data_wait_s for r in records), sum(r.step_s for r in records))


def _ratio(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0
