"""``geoshard train``: launches torchrun with ``-m geoshard.trainer`` for the user, then prints
the IO-wait report of the run."""

from __future__ import annotations

from typing import Any

import click

from geoshard.errors import GeoshardError
from geoshard.trainer.options import config_from, train_options


class TrainingFailed(GeoshardError):
    exit_code = 1


@click.command()
@train_options
@click.option("--nproc", default=2, show_default=True, type=click.IntRange(min=1), help="Ranks on this node.")
@click.option("--max-restarts", default=0, show_default=True, type=click.IntRange(min=0), help="torchrun restarts after a failure.")
def train(nproc: int, max_restarts: int, **kwargs: Any) -> None:
    """Train with torchrun on this node and print the IO-wait report."""
    from geoshard.cli_report import render_report
    from geoshard.trainer.launch import launch
    from geoshard.trainer.report import build_report

    cfg = config_from(**kwargs)
    code = launch(cfg, nproc, max_restarts)
    if code != 0:
        raise TrainingFailed(f"torchrun exited with {code}; the ranks' errors are above, their step logs in {cfg.out}")
    click.echo(render_report(build_report(cfg.out, cfg.budget)))
