"""CLI commands that move shards between this machine and the regional buckets."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from geoshard.cli.common import created_time, plan_option, quiet_dask, request_timeout, s3_access
from geoshard.errors import ConfigError, GeoshardError
from geoshard.manifest.verify import MODES as VERIFY_MODES
from geoshard.plan import load_plan
from geoshard.split import SplitSettings
from geoshard.sync.pull import PullReport
from geoshard.sync.push import SyncReport, SyncSettings
from geoshard.util.retry import Backoff

_SYNC_KEYS = ("regions", "dry_run", "delete", "keep_generations", "workers", "retries", "create_buckets", "verify_remote", "endpoint")


def _sync_options(f: Callable[..., None]) -> Callable[..., None]:
    """The options sync and refresh share, handed to the command as one ``sync_settings``."""

    @functools.wraps(f)
    def command(**kw: Any) -> None:
        f(sync_settings=_sync_settings(**{k: kw.pop(k) for k in _SYNC_KEYS}), **kw)

    for opt in reversed(
        [
            click.option("--region", "regions", multiple=True, help="Only this region (repeatable)."),
            click.option("--dry-run", is_flag=True, help="Show what would move; change nothing."),
            click.option("--delete", is_flag=True, help="After publishing, delete objects no kept generation names."),
            click.option("--keep-generations", type=click.IntRange(min=0), default=1, show_default=True),
            click.option(
                "--workers",
                "--transfer-workers",
                "workers",
                type=click.IntRange(min=1),
                default=64,
                show_default=True,
                help="s5cmd --numworkers.",
            ),
            click.option("--retries", type=click.IntRange(min=0), default=2, show_default=True, help="Batch retries of failed objects."),
            click.option("--create-buckets", is_flag=True, help="Create missing buckets instead of failing."),
            click.option("--verify-remote", is_flag=True, help="Download and hash every published shard; upload again any that differs."),
            click.option("--endpoint", help="S3 endpoint for regions without one in the plan (else AWS_ENDPOINT_URL)."),
            click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout."),
        ]
    ):
        command = opt(command)
    return command


def _sync_settings(
    regions: tuple[str, ...],
    dry_run: bool,
    delete: bool,
    keep_generations: int,
    workers: int,
    retries: int,
    create_buckets: bool,
    verify_remote: bool,
    endpoint: str | None,
) -> SyncSettings:
    return SyncSettings(
        regions=regions,
        dry_run=dry_run,
        delete=delete,
        keep_generations=keep_generations,
        workers=workers,
        create_buckets=create_buckets,
        verify_remote=verify_remote,
        timeout_s=request_timeout(),
        default_endpoint=s3_access(None, endpoint).default_endpoint,
        backoff=Backoff(attempts=retries + 1, base=1.0),
    )


def _print_sync(report_dict: dict, as_json: bool) -> None:  # type: ignore[type-arg]
    from geoshard.cli.progress import sync_table

    if as_json:
        click.echo(json.dumps(report_dict, indent=1))
    else:
        sync_table(report_dict)


@click.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@plan_option
@_sync_options
def sync(directory: Path, plan_path: Path, sync_settings: SyncSettings, as_json: bool) -> None:
    """Publish each region's shards of the split in DIRECTORY to its bucket."""
    from geoshard.cli.progress import transfer_progress
    from geoshard.sync.push import sync as run_sync

    plan = load_plan(plan_path)
    with transfer_progress(enabled=not as_json) as progress:
        report = run_sync(directory, plan, sync_settings, progress=progress.update)
    _print_sync(report.to_dict(), as_json)
    if not report.ok:
        _region_errors(report)
        sys.exit(1)


def _region_errors(report: SyncReport) -> None:
    """One line on stderr per region that was not published, whatever went to stdout."""
    for name, r in report.regions.items():
        if r.error:
            click.echo(f"geoshard: error: region {name} not published: {r.error}", err=True)


@click.command()
@plan_option
@click.option("--region", "regions", multiple=True, help="Only this region (repeatable); default: every region with local = in the plan.")
@click.option(
    "--to",
    "--out",
    "to",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local replica folder (default: the region's local = in the plan); one --region with it.",
)
@click.option(
    "--workers", "--transfer-workers", "workers", type=click.IntRange(min=1), default=64, show_default=True, help="s5cmd --numworkers."
)
@click.option("--endpoint", help="S3 endpoint when the plan has none for the region.")
@click.option(
    "--verify",
    type=click.Choice(VERIFY_MODES),
    default="xxh3",
    show_default=True,
    help="Check every shard by the manifest's xxh3_128 (sha256 where it has none), or by sha256 (cryptographic).",
)
@click.option("--json", "as_json", is_flag=True)
def pull(
    plan_path: Path, regions: tuple[str, ...], to: Path | None, workers: int, endpoint: str | None, verify: str, as_json: bool
) -> None:
    """Fill local replicas of regions from their buckets; every shard verified (xxh3_128 by default)."""
    from geoshard.cli.progress import transfer_progress
    from geoshard.sync.pull import PullSettings, pull_targets
    from geoshard.sync.pull import pull as run_pull
    from geoshard.sync.remote import BucketTarget

    plan = load_plan(plan_path)
    targets, skipped = pull_targets(plan, regions, to)
    single = len(regions) == 1  # one region asked for: its error and its --json report, as before
    reports: dict[str, PullReport] = {}
    failed: dict[str, str] = {}
    for name, folder in targets:
        target = BucketTarget.of(plan.region(name), s3_access(None, endpoint).default_endpoint)
        settings = PullSettings(to=folder, workers=workers, timeout_s=request_timeout(), verify=verify)
        try:
            with transfer_progress(enabled=not as_json) as progress:
                reports[name] = run_pull(target, settings, progress=progress.update)
        except GeoshardError as e:
            if single:
                raise
            failed[name] = e.message
            continue
        if not as_json:
            click.echo(_pull_line(reports[name], folder))
    if not as_json:
        for name, why in skipped.items():
            click.echo(f"{name}: skipped ({why})")
    elif single:
        click.echo(json.dumps(reports[regions[0]].to_dict(), indent=1))
    else:
        regions_json = {n: r.to_dict() for n, r in reports.items()}
        click.echo(json.dumps({"regions": regions_json, "skipped": skipped, "failed": failed}, indent=1))
    for name, message in failed.items():
        click.echo(f"geoshard: error: region {name} not pulled: {message}", err=True)
    if failed:
        sys.exit(1)


def _pull_line(report: PullReport, folder: Path) -> str:
    return (
        f"{report.region}: {report.downloaded} shards fetched ({report.bytes_downloaded:,} bytes), {report.skipped} already present, "
        f"into {folder}" + (f"; checked by {report.hash}" if report.hash else "") + _indexes_part(report) + _local_part(report)
    )


def _local_part(report: PullReport) -> str:
    """How the files already there were found correct: by their recorded stat, or read again."""
    if not report.stat_matched and not report.rehashed:
        return ""
    return f"; {report.stat_matched} local files unchanged by stat, {report.rehashed} re-read ({report.bytes_rehashed:,} bytes)"


def _indexes_part(report: PullReport) -> str:
    """A version 2 region's chunk indexes; nothing for a region without them (version 1)."""
    if not report.indexes_downloaded and not report.indexes_skipped:
        return ""
    return f"; {report.indexes_downloaded} chunk indexes fetched, {report.indexes_skipped} already present"


@click.command()
@click.argument("sources", nargs=-1, required=True)
@plan_option
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="The split folder kept between runs.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Run report (default: OUT/reports/refresh-<time>.json).",
)
@click.option("--split-workers", type=click.IntRange(min=1), help="Dask workers for the split (default: one per core).")
@click.option("--scheduler", help="Run the split on an existing Dask cluster.")
@_sync_options
def refresh(
    sources: tuple[str, ...],
    plan_path: Path,
    out: Path,
    report_path: Path | None,
    split_workers: int | None,
    scheduler: str | None,
    sync_settings: SyncSettings,
    as_json: bool,
) -> None:
    """The nightly job: split new or changed SOURCES into OUT, sync, write a run report."""
    from geoshard.refresh import RefreshSettings
    from geoshard.refresh import refresh as run_refresh

    if sync_settings.dry_run:
        raise ConfigError("--dry-run: not supported by refresh (it would still split); use geoshard sync --dry-run")
    quiet_dask()
    plan = load_plan(plan_path)
    split_settings = SplitSettings(
        out=out,
        workers=split_workers,
        scheduler=scheduler,
        s3=s3_access(plan, sync_settings.default_endpoint),
        created=created_time(),
        incremental=True,
    )
    settings = RefreshSettings(
        split=split_settings,
        sync=sync_settings,
        report=report_path,
    )
    report = run_refresh(list(sources), plan, settings)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
    else:
        s = report.split
        what = "nothing new" if s["unchanged"] else f"{len(s['groups_run'])} group(s) split, {s['samples_split']:,} samples"
        click.echo(f"refresh: {what}; generation {s['generation']}")
        if report.sync:
            _print_sync(report.sync.to_dict(), False)
    if not report.ok:
        if report.sync:
            _region_errors(report.sync)
        sys.exit(1)


@click.command()
@plan_option
@click.option("--region", "regions", multiple=True, help="Only this region (repeatable).")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path), default=Path("probe.png"), show_default=True, help="Heatmap file.")
@click.option("--samples", type=click.IntRange(min=1), default=5, show_default=True, help="Small requests per region.")
@click.option("--write", is_flag=True, help="Allow a 4 MB probe object in empty prefixes (deleted afterwards).")
@click.option("--endpoint", help="S3 endpoint for regions without one in the plan.")
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--write-wan",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also set this host's region's links (half the median round trip, one way) in this WAN matrix file (docs/wan.md).",
)
def probe(
    plan_path: Path,
    regions: tuple[str, ...],
    png: Path,
    samples: int,
    write: bool,
    endpoint: str | None,
    as_json: bool,
    write_wan: Path | None,
) -> None:
    """Latency and throughput from this machine to every region's bucket, with a heatmap."""
    from geoshard.sync.probe import ProbeSettings, render_heatmap, render_text
    from geoshard.sync.probe import probe as run_probe

    plan = load_plan(plan_path)
    settings = ProbeSettings(
        regions=regions,
        samples=samples,
        write=write,
        default_endpoint=s3_access(None, endpoint).default_endpoint,
        timeout_s=request_timeout(),
    )
    result = run_probe(plan, settings)
    render_heatmap(result, png)
    from geoshard.env import read_environment
    from geoshard.wan.matrix import Link, update_matrix

    links: tuple[Link, ...] = ()
    if write_wan is not None:
        env = read_environment()
        rtts = {c.region: c.latency_ms_median for c in result.cells if c.latency_ms_median is not None}
        links = update_matrix(write_wan, env.geoshard_region or env.region, rtts, comment=f"geoshard probe from {result.origin}")
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        click.echo(render_text(result))
        click.echo(f"heatmap: {png}")
        for link in links:
            click.echo(f"WAN matrix {write_wan}: {link.a} <-> {link.b} {link.latency_ms:g} ms one way")
    if not all(c.ok for c in result.cells):
        for c in result.cells:
            if not c.ok:
                click.echo(f"geoshard: error: region {c.region}: {c.error}", err=True)
        sys.exit(1)
