"""Terminal output of the CLI: the split progress bar and summary tables (rich, stderr/stdout)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from geoshard.util.units import human_bytes

if TYPE_CHECKING:
    from geoshard.split import SplitResult


# Wide enough for any table geoshard prints; rich never pads plain lines to it.
UNCUT_WIDTH = 1000


def stdout_console() -> Console:
    """stdout for tables: the terminal's width on a terminal; otherwise (cron logs, ``| tee``,
    a file) no width to cut cells to, since rich would assume 80 columns and write ``us-east…``."""
    console = Console()
    return console if console.is_terminal else Console(width=UNCUT_WIDTH)


class CounterProgress:
    """A live line of counters summed from events (dicts of increments); draws only on a terminal.

    ``template`` formats the totals, plus ``mb`` (bytes / 1e6) and ``rate`` (MB/s so far).
    """

    def __init__(self, label: str, counters: tuple[str, ...], template: str, enabled: bool = True) -> None:
        console = Console(stderr=True)
        self.enabled = enabled and console.is_terminal
        self.lock = threading.Lock()
        self.totals = dict.fromkeys((*counters, "bytes"), 0)
        self.started = time.monotonic()
        self.bar = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(bar_width=None),
            TaskProgressColumn(),  # a percentage once the total is known
            TextColumn(template),
            TimeElapsedColumn(),
            console=console,
            disable=not self.enabled,
            transient=True,
        )
        self.task = self.bar.add_task(label, total=None, **self._fields())

    def _fields(self) -> dict[str, Any]:
        mb = self.totals["bytes"] / 1e6
        return {**self.totals, "mb": mb, "rate": mb / max(time.monotonic() - self.started, 1e-6)}

    def update(self, event: dict[str, int]) -> None:
        with self.lock:
            if "total_bytes" in event:  # the job's size, once known: the bar fills by bytes read
                self.bar.update(self.task, total=event["total_bytes"])
            for k, v in event.items():
                if k in self.totals:
                    self.totals[k] += v
            self.bar.update(self.task, completed=self.totals["bytes"], **self._fields())

    def __enter__(self) -> CounterProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.bar.__exit__(t, e, tb)


def split_progress(enabled: bool = True) -> CounterProgress:
    """Samples, MB and shards of a split, from the workers' events."""
    return CounterProgress(
        "split", ("samples", "shards"), "{task.fields[samples]:,} samples  {task.fields[mb]:.1f} MB  {task.fields[shards]} shards", enabled
    )


def transfer_progress(enabled: bool = True) -> CounterProgress:
    """Objects, MB and MB/s of s5cmd transfers as batches complete."""
    return CounterProgress(
        "transfer", ("objects",), "{task.fields[objects]:,} objects  {task.fields[mb]:.1f} MB  {task.fields[rate]:.1f} MB/s", enabled
    )


def regions_table(regions: Mapping[str, Mapping[str, Any]], title: str) -> None:
    """Shards, samples, bytes and share per region (``{name: {"shards", "samples", "bytes"}}``)."""
    table = Table(title=Text(title, no_wrap=True, overflow="ignore"))  # a folder path: one line, never folded
    for col in ("region", "shards", "samples", "bytes", "share"):
        table.add_column(col, justify="left" if col == "region" else "right")
    total = sum(r["samples"] for r in regions.values()) or 1
    for name, r in regions.items():
        table.add_row(name, str(r["shards"]), f"{r['samples']:,}", human_bytes(r["bytes"]), f"{100 * r['samples'] / total:.1f}%")
    stdout_console().print(table)


def split_table(result: SplitResult) -> None:
    m = result.manifest
    rate = result.samples_in / result.seconds if result.seconds else 0.0
    regions_table({n: r.to_dict() for n, r in m.regions.items()}, title=f"split generation {m.generation} ({m.format})")
    stdout_console().print(
        f"{result.samples_in:,} samples, {human_bytes(result.bytes_in)} in {result.seconds:.1f} s "
        f"({rate:,.0f} samples/s, {result.bytes_in / 1e6 / max(result.seconds, 1e-9):.0f} MB/s)"
    )


def sync_table(report: dict[str, Any]) -> None:
    title = "sync (dry run: nothing changed)" if report.get("dry_run") else "sync"
    table = Table(title=title)
    for col in ("region", "uploaded", "skipped", "deleted", "failed", "bytes", "generation", "status"):
        table.add_column(col, justify="left" if col in ("region", "status") else "right")
    for name, r in report["regions"].items():
        status = "published" if r.get("published") else ("would publish" if report.get("dry_run") and not r.get("error") else "FAILED")
        table.add_row(
            name,
            str(r["uploaded"]),
            str(r["skipped"]),
            str(r["deleted"]),
            str(r["failed"]),
            human_bytes(r["bytes_uploaded"]),
            str(r["generation"]),
            status,
        )
    stdout_console().print(table)
