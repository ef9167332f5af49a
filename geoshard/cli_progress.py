"""Terminal output of the CLI: the split progress bar and summary tables (rich, stderr/stdout)."""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from geoshard.units import human_bytes

if TYPE_CHECKING:
    from geoshard.manifest import Manifest
    from geoshard.split import SplitResult


class SplitProgress:
    """Counts samples, MB and shards from the workers' events; draws only on a terminal."""

    def __init__(self, enabled: bool = True) -> None:
        console = Console(stderr=True)
        self.enabled = enabled and console.is_terminal
        self.lock = threading.Lock()
        self.samples = self.bytes = self.shards = 0
        self.bar = Progress(
            TextColumn("[bold]split"),
            BarColumn(bar_width=None),
            TextColumn("{task.fields[samples]:,} samples  {task.fields[mb]:.1f} MB  {task.fields[shards]} shards"),
            TimeElapsedColumn(),
            console=console,
            disable=not self.enabled,
            transient=True,
        )
        self.task = self.bar.add_task("split", total=None, samples=0, mb=0.0, shards=0)

    def update(self, event: dict[str, int]) -> None:
        with self.lock:
            self.samples += event.get("samples", 0)
            self.bytes += event.get("bytes", 0)
            self.shards += event.get("shards", 0)
            self.bar.update(self.task, samples=self.samples, mb=self.bytes / 1e6, shards=self.shards)

    def __enter__(self) -> SplitProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.bar.__exit__(t, e, tb)


def regions_table(m: Manifest, title: str) -> None:
    table = Table(title=title)
    for col in ("region", "shards", "samples", "bytes", "share"):
        table.add_column(col, justify="left" if col == "region" else "right")
    total = sum(r.samples for r in m.regions.values()) or 1
    for name, r in m.regions.items():
        table.add_row(name, str(r.shards), f"{r.samples:,}", human_bytes(r.bytes), f"{100 * r.samples / total:.1f}%")
    Console().print(table)


def split_table(result: SplitResult) -> None:
    m = result.manifest
    rate = result.samples_in / result.seconds if result.seconds else 0.0
    regions_table(m, title=f"split generation {m.generation} ({m.format})")
    Console().print(
        f"{result.samples_in:,} samples, {human_bytes(result.bytes_in)} in {result.seconds:.1f} s "
        f"({rate:,.0f} samples/s, {result.bytes_in / 1e6 / max(result.seconds, 1e-9):.0f} MB/s)"
    )


class TransferProgress:
    """Objects, bytes and rate of s5cmd transfers as they complete; draws only on a terminal."""

    def __init__(self, enabled: bool = True) -> None:
        console = Console(stderr=True)
        self.enabled = enabled and console.is_terminal
        self.lock = threading.Lock()
        self.objects = self.bytes = 0
        self.started = time.monotonic()
        self.bar = Progress(
            TextColumn("[bold]transfer"),
            BarColumn(bar_width=None),
            TextColumn("{task.fields[objects]:,} objects  {task.fields[mb]:.1f} MB  {task.fields[rate]:.1f} MB/s"),
            TimeElapsedColumn(),
            console=console,
            disable=not self.enabled,
            transient=True,
        )
        self.task = self.bar.add_task("transfer", total=None, objects=0, mb=0.0, rate=0.0)

    def update(self, event: dict[str, int]) -> None:
        with self.lock:
            self.objects += event.get("objects", 0)
            self.bytes += event.get("bytes", 0)
            rate = self.bytes / 1e6 / max(time.monotonic() - self.started, 1e-6)
            self.bar.update(self.task, objects=self.objects, mb=self.bytes / 1e6, rate=rate)

    def __enter__(self) -> TransferProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.bar.__exit__(t, e, tb)


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
    Console().print(table)
