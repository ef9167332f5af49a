"""One rank's files in RUN_DIR as the training loop keeps them across resumes and restarts: the
step log (``steps-rank{R}.jsonl``), the keys log (``keys-rank{R}.jsonl``, ``--log-keys``) and the
rank summary (``rank{R}.json``), through the records' one writer and reader."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import TextIO

from geoshard.errors import DataError
from geoshard.trainer.record import StepRecord, read_steps, write_steps
from geoshard.trainer.summary import RankSummary, read_summary, write_summary


class RunLogs:
    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        self.steps = out / f"steps-rank{rank}.jsonl"
        self.keys = out / f"keys-rank{rank}.jsonl"

    def last_step(self) -> int:
        """The newest step in the step log (before a resume trims it)."""
        return max((r.step for r in self._records()), default=0)

    def start_segment(self, step: int) -> int:
        """Forget the steps about to be redone (a resume at ``step``; all of them without one) and
        return this start's segment: each start of the loop (first run, resume, restart) is a new one."""
        if step:
            write_steps(self.steps, [r for r in self._records() if r.step <= step])
            _keep_keys(self.keys, step)
        else:
            self.steps.unlink(missing_ok=True)
            self.keys.unlink(missing_ok=True)
        return max((r.segment for r in self._records()), default=-1) + 1

    def open_steps(self) -> TextIO:
        return self.steps.open("a", encoding="utf-8")

    def open_keys(self) -> TextIO:
        return self.keys.open("a", encoding="utf-8")

    def finish(self, summary: RankSummary, segment: int) -> RankSummary:
        """Write the rank summary of this segment, carrying those of the earlier ones (the file is
        written anew each time), so the report counts the loader's work of the whole run."""
        summary = dataclasses.replace(summary, segment=segment, earlier_segments=self._earlier(segment))
        write_summary(self.out, summary)
        return summary

    def _records(self) -> list[StepRecord]:
        return read_steps(self.steps, self.rank) if self.steps.exists() else []

    def _earlier(self, segment: int) -> tuple[RankSummary, ...]:
        path = self.out / f"rank{self.rank}.json"
        if segment == 0 or not path.exists():
            return ()
        try:
            old = read_summary(path, self.rank)
        except DataError:  # a segment that died mid-write left none worth keeping
            return ()
        if (old.segment or 0) >= segment:
            return ()
        return (*(old.earlier_segments or ()), dataclasses.replace(old, earlier_segments=None))


def _keep_keys(path: Path, upto: int) -> None:
    """The keys log without the steps about to be redone."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            if json.loads(line)["step"] <= upto:
                kept.append(line + "\n")
    path.write_text("".join(kept))
