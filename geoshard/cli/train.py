"""``geoshard train``: launches torchrun with ``-m geoshard.trainer`` for the user, then prints
the IO-wait report of the run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from geoshard.errors import ConfigError, GeoshardError
from geoshard.trainer.options import config_from, train_options


class TrainingFailed(GeoshardError):
    exit_code = 1


@click.command()
@train_options
@click.option("--nproc", default=2, show_default=True, type=click.IntRange(min=1), help="Ranks on this node.")
@click.option(
    "--regions",
    "regions_spec",
    help="One job across regions on this machine: ranks per region, e.g. us-east-1:2,eu-west-1:1 (one torchrun agent per region).",
)
@click.option(
    "--wan",
    "wan_matrix",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --regions: run each region in its own network namespace behind this latency/bandwidth matrix (TOML; root).",
)
@click.option("--max-restarts", default=0, show_default=True, type=click.IntRange(min=0), help="torchrun restarts after a failure.")
@click.option("--overwrite", is_flag=True, help="Start over in an --out that holds an earlier run (without --resume it is refused).")
def train(nproc: int, regions_spec: str | None, wan_matrix: Path | None, max_restarts: int, overwrite: bool, **kwargs: Any) -> None:
    """Train with torchrun on this node and print the IO-wait report."""
    from geoshard.cli.report import render_report
    from geoshard.cli.train_progress import TrainProgress
    from geoshard.plan import load_plan
    from geoshard.trainer.config import parse_regions
    from geoshard.trainer.launch import launch, launch_regions
    from geoshard.trainer.preflight import preflight
    from geoshard.trainer.report import build_report

    cfg = config_from(**kwargs)
    if cfg.sync == "diloco" and regions_spec is None:
        raise ConfigError(
            "--sync diloco needs --regions (one torchrun per region); with your own torchrun per region, run "
            "python -m geoshard.trainer with --outer-store and --outer-regions (docs/diloco.md)"
        )
    # The plan, the region(s), the options and the corpus layout, before torchrun starts.
    preflight(cfg, nproc, [r.region for r in parse_regions(regions_spec)] if regions_spec is not None else (), overwrite=overwrite)
    progress = TrainProgress(cfg.out, cfg.steps).start()  # step, loss, samples/s, data wait, from the step logs
    click.get_current_context().call_on_close(progress.close)
    if regions_spec is not None:
        regions = parse_regions(regions_spec)
        plan = load_plan(cfg.plan)
        for r in regions:
            plan.region(r.region)  # an unknown region: one line naming the plan's regions, before launch
        if wan_matrix is not None:
            # The CLI, the process's edge, sets what torch reads when it loads (after this): this
            # process hosts the rendezvous stores inside the namespaces, where the host's DNS is out
            # of reach, and c10d warns per connection that a peer's reverse lookup failed (EAI_AGAIN).
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            from geoshard.wan.launch import launch_under_wan

            code = launch_under_wan(cfg, regions, max_restarts, wan_matrix, click.echo)
        else:
            code = launch_regions(cfg, regions, max_restarts)
    elif wan_matrix is not None:
        raise ConfigError("--wan needs --regions (the ranks per region to put in each region's namespace)")
    else:
        code = launch(cfg, nproc, max_restarts)
    progress.close()
    if code != 0:
        raise launch_failure(cfg.out, code)
    report = build_report(cfg.out, cfg.budget)
    if cfg.sync == "diloco":  # the regions end apart, so no rank writes it (trainer/loop.py)
        from geoshard.trainer.report import write_report

        write_report(cfg.out, report)
    click.echo(render_report(report))


def launch_failure(out: Path, code: int) -> GeoshardError:
    """The failed rank's own line and exit code; else the signal that killed an agent or a rank
    (the others' errors are its consequences); else the first rank that crashed; else what the
    log's last traceback says, and where the ranks' output is."""
    from geoshard.trainer.failures import RankFailed, first_failure, last_traceback_line, logs_dir, recorded_stop

    failure = first_failure(out)
    if failure is not None:
        return RankFailed(failure)
    where = f"the ranks' output: {logs_dir(out) / 'stderr.log'}"
    stop = recorded_stop(out)
    if stop is not None:
        return TrainingFailed(f"training stopped: {stop}; {where}")
    crashed = first_failure(out, kind="crash")
    if crashed is not None:
        return RankFailed(crashed)
    crash = last_traceback_line(out)
    what = f"training stopped (torchrun exit {code})" + (f": {crash}" if crash else "")
    return TrainingFailed(f"{what}; {where}")
