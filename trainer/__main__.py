"""``torchrun --nproc-per-node N -m geoshard.trainer --plan PLAN --region R --steps S --out RUN_DIR``."""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import click

from geoshard.errors import GeoshardError
from geoshard.trainer.exit import exit_rank
from geoshard.trainer.options import config_from, train_options


def process_started_at() -> float:
    """When this process started, on the wall clock (Linux: /proc, 10 ms ticks; elsewhere: now,
    before torch is imported). The report's start-up counts from the earliest rank's."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


STARTED_AT = process_started_at()


def one_write_per_line() -> None:
    """torchrun starts ranks with ``python -u``, where print's text and its newline are two writes
    to the stdout every rank of the job shares, and two ranks' lines ran together (a DiLoCo job's
    regions announce at the same instant). Line buffered, each line is one write, and still out as
    soon as it ends."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True, write_through=False)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@train_options
def main(**kwargs: Any) -> None:
    """Train the demo model with DDP on one region's data and write RUN_DIR/report.json."""
    one_write_per_line()
    # A job that seems stuck: SIGUSR1 to a rank (or a loader worker, which inherits this) prints
    # every thread's stack to stderr, the run's logs/stderr.log under geoshard train.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from geoshard.trainer.failures import record_crash, record_failure
    from geoshard.trainer.loop import start_environment, train

    try:
        cfg = config_from(**kwargs)
    except GeoshardError as e:  # geoshard train checks the options before launch; torchrun users see this line
        click.echo(f"geoshard.trainer: error: {e.message}", err=True)
        sys.exit(e.exit_code)  # before init_process_group: no gloo threads yet
    if (env := start_environment(cfg, os.environ)) is not None:
        # Start again, with the same interpreter options (torchrun's -u), in the environment
        # --nccl-algo / --socket-ifname ask for: same process id, so torchrun still follows it, and
        # this process's environment is never changed under torch.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # noqa: S606
    try:
        train(cfg, STARTED_AT)
    except GeoshardError as e:
        record_failure(cfg.out, int(os.environ.get("RANK", "0")), e)  # geoshard train prints it once
        click.echo(f"geoshard.trainer: error: {e.message}", err=True)
        exit_rank(e.exit_code)
    except Exception as e:  # a bug, or a value nothing checked: its own line for geoshard train, the traceback in the log
        traceback.print_exc()
        record_crash(cfg.out, int(os.environ.get("RANK", "0")), e)
        exit_rank(1)
    exit_rank(0)


if __name__ == "__main__":
    main()
