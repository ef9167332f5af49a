"""Drawing probe results: the region matrix as text, or as a PNG heatmap of latency."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from geoshard.sync.probe_records import ProbeCell, ProbeResult


def _rows(results: ProbeResult | Iterable[ProbeResult]) -> list[ProbeResult]:
    return [results] if isinstance(results, ProbeResult) else list(results)


def _columns(rows: Sequence[ProbeResult]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols.extend(n for n in r.regions if n not in cols)
    return cols


def _find(row: ProbeResult, region: str) -> ProbeCell | None:
    try:
        return row.cell(region)
    except KeyError:
        return None


def _cell_text(c: ProbeCell | None) -> str:
    if c is None:
        return "-"
    if c.latency_ms_median is None:
        return "error"
    text = f"{c.latency_ms_median:.1f}/{c.latency_ms_p90:.1f} ms"
    if c.throughput_mb_s is not None:
        text += f", {c.throughput_mb_s:.1f} MB/s"
    return text + (" (!)" if c.error else "")


def render_text(results: ProbeResult | Iterable[ProbeResult]) -> str:
    """The matrix as text: a row per host, a column per region; errors listed below."""
    rows = _rows(results)
    cols = _columns(rows)
    table = [["from \\ to", *cols]] + [[r.origin, *(_cell_text(_find(r, c)) for c in cols)] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    out = ["latency median/p90 ms, GET throughput MB/s"]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in table]
    errors = [(r.origin, c) for r in rows for c in r.cells if c.error]
    if errors:
        out.append("errors:")
        out += [f"  {origin} -> {c.region}: {c.error}" for origin, c in errors]
    skipped = sorted({s for r in rows for s in r.skipped})
    if skipped:
        out.append(f"not probed (no bucket): {', '.join(skipped)}")
    return "\n".join(out)


def render_heatmap(results: ProbeResult | Iterable[ProbeResult], path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG heatmap of median latency (log colour scale), host rows by region columns.

    Each cell is annotated with median and p90 latency and GET throughput; failed regions are
    grey and say "error". Uses matplotlib's object API with the Agg canvas directly, so neither
    pyplot's global figure state nor the process-wide backend is touched.
    """
    import matplotlib as mpl
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    rows = _rows(results)
    if not rows:
        raise ValueError("render_heatmap needs at least one probe result")
    cols = _columns(rows)
    grid = [[_find(r, c) for c in cols] for r in rows]
    values = np.array(
        [[c.latency_ms_median if c and c.latency_ms_median is not None else np.nan for c in line] for line in grid], dtype=float
    )
    masked = np.ma.masked_invalid(values)
    finite = values[np.isfinite(values)]
    if finite.size:
        lo = max(float(finite.min()) * 0.8, 0.1)
        hi = max(float(finite.max()) * 1.25, lo * 2)
        norm: Normalize = LogNorm(vmin=lo, vmax=hi)
    else:
        norm = Normalize(vmin=0.0, vmax=1.0)
    cmap = mpl.colormaps["YlOrRd"].with_extremes(bad="#d0d0d0")

    fig = Figure(figsize=(2.0 + 2.0 * max(len(cols), 1), 1.8 + 0.9 * len(rows)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(masked, cmap=cmap, norm=norm, aspect="auto")
    ax.set_xticks(range(len(cols)), labels=cols)
    ax.set_yticks(range(len(rows)), labels=[r.origin for r in rows])
    ax.set_xlabel("region bucket")
    ax.set_ylabel("from host")
    ax.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False)
    ax.xaxis.set_label_position("top")
    for i, line in enumerate(grid):
        for j, c in enumerate(line):
            if c is None:
                text, dark = "-", False
            elif c.latency_ms_median is None:
                text, dark = "error", False
            else:
                text = f"{c.latency_ms_median:.1f} ms\np90 {c.latency_ms_p90:.1f}"
                if c.throughput_mb_s is not None:
                    text += f"\n{c.throughput_mb_s:.1f} MB/s"
                dark = norm(c.latency_ms_median) > 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
    fig.colorbar(image, ax=ax, label="median latency (ms)")
    ax.set_title(title or "geoshard probe: latency from host to region buckets", fontsize=10)
    out = Path(path)
    fig.savefig(out, format="png")
    return out
