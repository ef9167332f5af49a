"""The progress of ``geoshard train``, followed from the ranks' step logs while torchrun runs."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from geoshard.errors import DataError
from geoshard.trainer.record import StepRecord, parse_step


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
            rank = _rank_of(p)
            for line in chunk[:end].splitlines():
                with contextlib.suppress(DataError):  # a record the report will name; progress goes on
                    rec = parse_step(line, p.name, rank)
                    if rec.segment >= first:
                        self._add(rec, rank0=rank == 0)
            self.files[p] = (inode, offset + end, first)

    def _add(self, rec: StepRecord, rank0: bool) -> None:
        if self.first_seen is None:
            self.first_seen = time.monotonic()
        self.step = max(self.step, rec.step)
        if rank0 and rec.loss is not None:
            self.loss = rec.loss
        self.window["samples"] += rec.samples
        self.window["wait"] += rec.data_wait_s
        self.window["busy"] += rec.step_s

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
            with contextlib.suppress(DataError):
                top = max(top, parse_step(line, path.name, _rank_of(path)).segment)
    return top


def _rank_of(path: Path) -> int:
    return int(path.name.removeprefix("steps-rank").removesuffix(".jsonl"))
