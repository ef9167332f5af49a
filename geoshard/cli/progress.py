"""Terminal output of the CLI: the split progress bar and summary tables (rich, stderr/stdout)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import click
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


class TrainProgress:
    """The progress of ``geoshard train``, followed from the ranks' step logs (RUN_DIR/steps-rank*.jsonl)
    while torchrun runs: step, loss, samples/s and the data-wait share. On a terminal a bar on
    stderr; otherwise (a log, a pipe) a line on stdout every ``every_s`` seconds.

    Records of earlier segments (a resumed run keeps its old steps) are not this run's: a log that
    was there at the start counts only records of a later segment, a new log all of them."""

    def __init__(self, run_dir: Path, steps: int, every_s: float = 5.0, poll_s: float = 0.5) -> None:
        self.run_dir, self.steps, self.every_s, self.poll_s = run_dir, steps, every_s, poll_s
        self.console = Console(stderr=True)
        self.terminal = self.console.is_terminal and Console().is_terminal
        self.files: dict[Path, tuple[int, int, int]] = {}  # path -> (inode, offset, first segment to count)
        for p in run_dir.glob("steps-rank*.jsonl"):
            with contextlib.suppress(OSError):
                self.files[p] = (p.stat().st_ino, 0, _max_segment(p) + 1)
        self.step, self.loss = 0, float("nan")
        self.window = {"samples": 0, "wait": 0.0, "busy": 0.0}
        self.first_seen: float | None = None  # when this run's first step record was read
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="geoshard-train-progress", daemon=True)
        self.bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=None),
            TextColumn(
                "step {task.completed:,.0f}/{task.total:,.0f}  loss {task.fields[loss]}  {task.fields[rate]}  data wait {task.fields[wait]}"
            ),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.terminal,
        )
        self.task = self.bar.add_task("train", total=steps, loss="-", rate="-", wait="-")

    def start(self) -> TrainProgress:
        self.bar.start()
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop following (idempotent); on a terminal the bar shows the last step read."""
        if self.stop.is_set():
            return
        self.stop.set()
        self.thread.join(5)
        if self.terminal:
            self.poll()
            self._draw()
        self.bar.stop()

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(self.poll_s):
            self.poll()
            now = time.monotonic()
            if self.terminal:
                self._draw()
            elif now - last >= self.every_s and self.window["busy"] > 0:
                click.echo(self.line(now - last))
                last = now
                self.window = {"samples": 0, "wait": 0.0, "busy": 0.0}

    def poll(self) -> None:
        """Read what the ranks appended since the last poll."""
        for p in sorted(self.run_dir.glob("steps-rank*.jsonl")):
            try:
                inode = p.stat().st_ino
                known = self.files.get(p)
                if known is None or known[0] != inode:  # a log started by this run (the old one was replaced)
                    known = (inode, 0, 0)
                _, offset, first = known
                with open(p, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1  # whole lines only: the rank may be writing the next one
            for line in chunk[:end].splitlines():
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    rec = json.loads(line)
                    if int(rec.get("segment", 0)) >= first:
                        self._add(rec, rank0=p.name == "steps-rank0.jsonl")
            self.files[p] = (inode, offset + end, first)

    def _add(self, rec: dict[str, Any], rank0: bool) -> None:
        if self.first_seen is None:
            self.first_seen = time.monotonic()
        self.step = max(self.step, int(rec["step"]))
        if rank0 and isinstance(rec.get("loss"), int | float):
            self.loss = float(rec["loss"])
        self.window["samples"] += int(rec.get("samples", 0))
        self.window["wait"] += float(rec.get("data_wait_s", 0.0))
        self.window["busy"] += float(rec.get("step_s", 0.0))

    def line(self, seconds: float) -> str:
        w = self.window
        share = w["wait"] / w["busy"] if w["busy"] else 0.0
        return (
            f"step {self.step:,}/{self.steps:,}  loss {self._loss()}  {w['samples'] / max(seconds, 1e-9):,.0f} samples/s  "
            f"data wait {share:.1%}"
        )

    def _loss(self) -> str:
        return f"{self.loss:.4g}" if self.loss == self.loss else "-"  # NaN: no loss (--model none) or none yet

    def _draw(self) -> None:
        """The bar: samples/s since this run's first step (the window holds them all on a terminal)."""
        w = self.window
        elapsed = time.monotonic() - self.first_seen if self.first_seen is not None else 0.0
        fields: dict[str, Any] = {"loss": self._loss()}
        if w["busy"] and elapsed >= 1.0:  # a rate over less than a second says little
            fields.update(rate=f"{w['samples'] / max(elapsed, 1e-9):,.0f} samples/s", wait=f"{w['wait'] / w['busy']:.1%}")
        self.bar.update(self.task, completed=self.step, **fields)


def _max_segment(path: Path) -> int:
    """The highest segment in an existing step log (-1: none)."""
    top = -1
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                top = max(top, int(json.loads(line).get("segment", 0)))
    return top
