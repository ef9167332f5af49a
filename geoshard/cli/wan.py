"""``geoshard wan check MATRIX``: build the rehearsal, measure it, print a table, tear it down."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from geoshard.errors import ConfigError


@click.group()
def wan() -> None:
    """WAN rehearsal: regions as network namespaces behind a latency and bandwidth matrix (needs root)."""


@wan.command()
@click.argument("matrix_path", metavar="MATRIX", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--regions", help="Comma-separated regions (default: every region of the matrix).")
@click.option("--rounds", type=click.IntRange(min=1, max=1000), default=5, show_default=True, help="TCP echo round trips per pair.")
@click.option(
    "--throughput",
    "throughput_s",
    type=click.FloatRange(min=0, max=60),
    default=0.0,
    show_default=True,
    help="Also measure one TCP stream per pair for this many seconds (0: skip).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def check(matrix_path: Path, regions: str | None, rounds: int, throughput_s: float, as_json: bool) -> None:
    """Build the namespaces of MATRIX, measure the forwarder's ceiling and each pair's RTT, remove them."""
    from geoshard.wan import Rehearsal, WanError, load_matrix, netns, require_root
    from geoshard.wan.measure import check as measure
    from geoshard.wan.measure import refuse_unmeasurable

    matrix = load_matrix(matrix_path)
    names = None
    if regions is not None:
        names = tuple(r.strip() for r in regions.split(",") if r.strip())
        if not names:
            raise ConfigError("--regions: give at least two comma-separated regions")
    refuse_unmeasurable(matrix, names)
    require_root()
    t0 = time.monotonic()
    with Rehearsal(matrix, regions=names) as w:
        started = time.monotonic() - t0
        if not as_json:
            where = ", ".join(f"{r} {w.address(r)}" for r in w.regions)
            click.echo(f"WAN rehearsal of {matrix_path}: {len(w.regions)} namespaces ({where}), started in {started:.1f} s")
            click.echo(f"{w.ceiling}; no delay, no cap: figures near it measure the forwarder, not the link")
        results = measure(w, rounds=rounds, throughput_s=throughput_s)
        ceiling = w.ceiling
        late = w.lateness()
        made = {w.netns(r) for r in w.regions}
    left = made & set(netns.list_namespaces())
    if left:
        raise WanError(f"namespaces left after stopping: {', '.join(sorted(left))}")
    if as_json:
        click.echo(json.dumps(_check_doc(matrix_path, w.regions, ceiling, late, results), indent=1))
        return
    _echo_pairs(results)
    click.echo(f"delayed packets left {late.mean_ms:.2f} ms late on average (max {late.max_ms:.1f} ms, {late.packets:,} packets)")
    click.echo(f"removed its {len(made)} namespaces and their TUN devices")


def _check_doc(matrix_path: Path, regions: Sequence[str], ceiling: Any, late: Any, results: Sequence[Any]) -> dict[str, Any]:
    """``wan check --json``: the figures of one check."""
    return {
        "matrix": str(matrix_path),
        "regions": list(regions),
        "ceiling": {"packets_per_s": round(ceiling.packets_per_s), "mb_per_s": round(ceiling.mb_per_s, 1)},
        "lateness_ms": {"packets": late.packets, "mean": round(late.mean_ms, 3), "max": round(late.max_ms, 3)},
        "pairs": [
            {
                "a": c.a,
                "b": c.b,
                "latency_ms": c.latency_ms,
                "rtt_expected_ms": 2 * c.latency_ms,
                "rtt_ms": round(c.rtt_ms, 2),
                "rtt_error": round(c.rtt_error, 4),
                "bandwidth_mbit": c.bandwidth_mbit,
                "measured_mbit": None if c.mbit is None else round(c.mbit, 2),
            }
            for c in results
        ],
    }


def _echo_pairs(results: Sequence[Any]) -> None:
    """One line per pair: the latency asked for against the round trip measured, and the cap."""
    width = max(len(f"{c.a} <-> {c.b}") for c in results)
    head = f"{'pair':<{width}}  {'one way':>8}  {'RTT want':>9}  {'RTT got':>9}  {'error':>7}  {'cap':>12}  {'got':>12}"
    click.echo(head)
    for c in results:
        cap = "none" if c.bandwidth_mbit is None else f"{c.bandwidth_mbit:g} Mbit/s"
        got = "-" if c.mbit is None else f"{c.mbit:.1f} Mbit/s"
        click.echo(
            f"{c.a + ' <-> ' + c.b:<{width}}  {c.latency_ms:>5g} ms  {2 * c.latency_ms:>6.1f} ms  {c.rtt_ms:>6.1f} ms"
            f"  {c.rtt_error:>+7.1%}  {cap:>12}  {got:>12}"
        )
