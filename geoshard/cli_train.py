"""``geoshard train``: launches torchrun with ``-m geoshard.trainer`` for the user, then prints
the IO-wait report of the run."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import click

from geoshard.errors import GeoshardError
from geoshard.trainer.options import config_from, train_options


class TrainingFailed(GeoshardError):
    exit_code = 1


def torchrun_argv(nproc: int, max_restarts: int, master_port: int, trainer_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
        "-m",
        "geoshard.trainer",
        *trainer_args,
    ]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@click.command()
@train_options
@click.option("--nproc", default=2, show_default=True, type=click.IntRange(min=1), help="Ranks on this node.")
@click.option("--max-restarts", default=0, show_default=True, type=click.IntRange(min=0), help="torchrun restarts after a failure.")
def train(nproc: int, max_restarts: int, **kwargs: Any) -> None:
    """Train with torchrun on this node and print the IO-wait report."""
    cfg = config_from(**kwargs)
    argv = torchrun_argv(nproc, max_restarts, free_port(), cfg.to_argv())
    r = subprocess.run(argv, check=False)  # noqa: S603 - argv list, no shell: nothing the user passes is interpreted
    if r.returncode != 0:
        raise TrainingFailed(f"torchrun exited with {r.returncode}; the ranks' errors are above, their step logs in {cfg.out}")
    from geoshard.cli_report import render_report
    from geoshard.trainer.report import build_report

    click.echo(render_report(build_report(cfg.out, cfg.budget)))
