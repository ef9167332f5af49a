"""Pieces shared by the CLI modules: options and the settings they build (at the edge)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from geoshard.env import read_environment
from geoshard.plan import Plan
from geoshard.s3 import REQUEST_TIMEOUT_S
from geoshard.split.sources import S3Access

F = TypeVar("F", bound=Callable[..., Any])


def quiet_dask() -> None:
    """distributed sets its own logger levels on import; keep its chatter below ours."""
    import distributed  # noqa: F401

    ours = logging.getLogger().getEffectiveLevel()
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in ("distributed", "tornado", "bokeh"):
            logging.getLogger(name).setLevel(max(ours, logging.ERROR) if ours > logging.DEBUG else ours)


def plan_option(f: F) -> F:
    return click.option("--plan", "plan_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Region plan (TOML).")(
        f
    )


def s3_access(plan: Plan | None, endpoint: str | None) -> S3Access:
    """Endpoints and profiles per bucket from the plan; the default endpoint from --endpoint or the environment."""
    env = read_environment()
    buckets, regions = [], []
    for r in plan.regions if plan else ():
        if r.bucket_name:
            buckets.append((r.bucket_name, r.endpoint, r.profile))
            regions.append((r.bucket_name, r.name))
    return S3Access(
        default_endpoint=endpoint or env.endpoint_url, buckets=tuple(buckets), regions=tuple(regions), timeout_s=request_timeout()
    )


def request_timeout() -> float:
    """Each S3 request's bound in seconds: GEOSHARD_TIMEOUT, else the default."""
    return read_environment().timeout_s or REQUEST_TIMEOUT_S


def created_time() -> str | None:
    """SOURCE_DATE_EPOCH, when set, fixes manifest creation times (reproducible builds)."""
    epoch = read_environment().source_date_epoch
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def name_envvars(group: click.Group, prefix: str = "GEOSHARD") -> None:
    """Give every option the variable docs/cli.md promises: ``GEOSHARD_<COMMAND>_<OPTION>``.

    click's ``auto_envvar_prefix`` derives the name from the Python parameter (``plan_path``,
    ``as_json``), not from the option a user types; naming each one here, from its first long
    option, keeps the two equal and lets ``--help`` show it. The parameter-derived names still
    work through the prefix (older scripts)."""

    for param in group.params:
        _name_envvar(param, prefix)
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            name_envvars(command, f"{prefix}_{name}")  # geoshard wan check --matrix: GEOSHARD_WAN_CHECK_MATRIX
            continue
        for param in command.params:
            _name_envvar(param, f"{prefix}_{name}")


def _name_envvar(param: click.Parameter, prefix: str) -> None:
    if isinstance(param, click.Option) and param.expose_value:
        long = next((o for o in param.opts if o.startswith("--")), param.opts[0])
        param.envvar, param.show_envvar = f"{prefix}_{long.lstrip('-')}".upper().replace("-", "_"), True
