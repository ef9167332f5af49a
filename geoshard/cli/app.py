"""The ``geoshard`` command line: thin click commands over the library.

Configuration is built here, at the edge, and passed down; errors become one line on stderr and
the exit code their class owns.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, TypeVar, cast

import click

from geoshard.cli.common import created_time, name_envvars, plan_option, quiet_dask, s3_access
from geoshard.errors import GeoshardError
from geoshard.formats import FORMATS, Format
from geoshard.manifest.verify import MODES as VERIFY_MODES
from geoshard.plan import load_plan
from geoshard.util.units import human_bytes

F = TypeVar("F", bound=Callable[..., Any])


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GeoshardError as e:
            click.echo(f"geoshard: error: {e.message}", err=True)
            ctx.exit(e.exit_code)
        except OSError as e:  # the environment failed (a full disk, a permission): one line, not a traceback
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"geoshard: error: {where}{e.strerror or e}", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"auto_envvar_prefix": "GEOSHARD", "help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(package_name="geoshard")
def main(verbose: int) -> None:
    """geoshard: region-local training data for multi-region DDP."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("distributed", "tornado", "bokeh", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(max(level, logging.ERROR))


@main.command()
@click.argument("sources", nargs=-1, required=True)
@plan_option
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output folder.")
@click.option(
    "--workers",
    "--split-workers",
    "workers",
    type=click.IntRange(min=1),
    help="Threads, or worker processes with --processes (default: one per core).",
)
@click.option("--scheduler", help="Run on an existing Dask cluster, e.g. tcp://10.0.0.5:8786.")
@click.option(
    "--processes/--threads",
    default=None,
    help=(
        "Tasks on an in-process Dask cluster of worker processes, or on Dask's threaded scheduler "
        "in this process (default: threads for local sources, processes for s3://)."
    ),
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Source format when file names do not tell.")
@click.option("--endpoint", help="S3 endpoint for s3:// sources whose bucket is not in the plan.")
@click.option("--replace", is_flag=True, help="Allow replacing a split of a different plan in --out.")
@click.option(
    "--allow-truncated-tar",
    is_flag=True,
    help="Split tars that end without end-of-archive blocks (each is reported with its sample count).",
)
@click.option(
    "--manifest-version",
    type=click.Choice(["1", "2"]),
    help="Region manifests: 1 lists each shard's chunk hashes inline; 2 keeps one entry per shard and "
    "writes each shard's chunk index beside it (<shard>.chunks), for regions of 10^5 shards (docs/manifest.md). "
    "Default: 2 for a split with a region of 10,000 shards or more, else the version of the split already in --out, else 1.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def split(
    sources: tuple[str, ...],
    plan_path: Path,
    out: Path,
    workers: int | None,
    scheduler: str | None,
    processes: bool | None,
    fmt: str | None,
    endpoint: str | None,
    replace: bool,
    allow_truncated_tar: bool,
    manifest_version: str | None,
    as_json: bool,
) -> None:
    """Re-shard SOURCE... by region following --plan into --out."""
    from geoshard.cli.progress import split_progress, split_table
    from geoshard.split import SplitSettings, run_split

    if scheduler or processes or any(s.startswith("s3://") for s in sources):
        quiet_dask()  # imports distributed, which the default (threaded) path does without
    plan = load_plan(plan_path)
    settings = SplitSettings(
        out=out,
        workers=workers,
        scheduler=scheduler,
        processes=processes,
        fmt=cast(Format | None, fmt),
        s3=s3_access(plan, endpoint),
        replace=replace,
        created=created_time(),
        allow_truncated_tar=allow_truncated_tar,
        manifest_version=int(manifest_version) if manifest_version else None,
    )
    with split_progress(enabled=not as_json) as progress:
        result = run_split(list(sources), plan, settings, progress=progress.update)
    for url, n in result.truncated:
        click.echo(f"geoshard: warning: {url}: tar ends without end-of-archive blocks; split the {n:,} samples it holds", err=True)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "out": str(out),
                    "generation": result.manifest.generation,
                    "format": result.manifest.format,
                    "samples_in": result.samples_in,
                    "bytes_in": result.bytes_in,
                    "seconds": round(result.seconds, 3),
                    "cluster_seconds": round(result.cluster_seconds, 3),
                    "cluster": result.cluster,
                    "job_seconds": round(result.job_seconds, 3),
                    "regions": {n: r.to_dict() for n, r in result.manifest.regions.items()},
                    "truncated": [{"source": url, "samples": n} for url, n in result.truncated],
                },
                indent=1,
            )
        )
    else:
        split_table(result)


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--verify",
    "mode",
    type=click.Choice(VERIFY_MODES),
    default="xxh3",
    show_default=True,
    help="Check by the manifest's xxh3_128 (sha256 where it has none), or by sha256 (cryptographic).",
)
@click.option("--json", "as_json", is_flag=True)
def verify(directory: Path, mode: str, as_json: bool) -> None:
    """Re-hash every shard of the split in DIRECTORY against its manifest."""
    from geoshard.manifest.verify import verify_split

    _, report = verify_split(directory, mode)
    if as_json:
        hashes = "+".join(sorted(report.hashes))
        click.echo(json.dumps({"checked": report.checked, "missing": report.missing, "mismatched": report.mismatched, "hash": hashes}))
    else:
        for p in report.missing:
            click.echo(f"missing: {p}")
        for p in report.mismatched:
            click.echo(f"mismatched: {p}")
        click.echo(f"{report.checked} shards checked, {len(report.missing)} missing, {len(report.mismatched)} mismatched")
    if not report.ok:
        sys.exit(1)


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def inspect(directory: Path, as_json: bool) -> None:
    """Show the regions, shards, samples and bytes of the split in DIRECTORY (or of the one region
    whose manifest DIRECTORY holds: a region folder of a split, a pulled replica)."""
    from geoshard.cli.progress import regions_table
    from geoshard.manifest import RegionManifest, read_split_or_region

    m = read_split_or_region(directory)
    if isinstance(m, RegionManifest):
        regions = {m.region: {"shards": len(m.shards), "samples": m.samples, "bytes": m.bytes}}
        title = f"{directory} (region {m.region}, generation {m.generation}, {m.format})"
    else:
        regions = {n: r.to_dict() for n, r in m.regions.items()}
        title = f"{directory} (generation {m.generation}, {m.format})"
    if as_json:
        click.echo(json.dumps({"generation": m.generation, "format": m.format, "regions": regions}, indent=1))
    else:
        regions_table(regions, title=title)


@main.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="wds", show_default=True)
@click.option("--samples", type=click.IntRange(min=1), default=10000, show_default=True)
@click.option("--sample-bytes", type=click.IntRange(min=1), default=1000, show_default=True, help="Size of each sample's image bytes.")
@click.option("--shard-samples", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--origins", help="Comma-separated origin regions (default: us-east-1,eu-west-1,ap-southeast-1).")
@click.option("--seed", type=int, default=0, show_default=True)
def synth(out: Path, fmt: str, samples: int, sample_bytes: int, shard_samples: int, origins: str | None, seed: int) -> None:
    """Write a synthetic corpus to OUT (image-like bytes, a label, an origin)."""
    from geoshard.local.synth import SynthSpec, parse_origins, synth_files
    from geoshard.local.synth import synth as make

    spec = SynthSpec(
        out=out,
        fmt=cast(Format, fmt),
        samples=samples,
        sample_bytes=sample_bytes,
        shard_samples=shard_samples,
        seed=seed,
        **({"origins": tuple(parse_origins(origins) or ())} if origins is not None else {}),
    )
    earlier = synth_files(out)
    paths = make(spec)
    size = sum(p.stat().st_size for p in paths)
    removed = len(set(earlier) - set(paths))
    note = f"; removed {removed} shard(s) of an earlier synth run" if removed else ""
    click.echo(f"wrote {samples} samples in {len(paths)} {fmt} shards ({human_bytes(size)}) to {out}{note}")


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-out"), show_default=True)
@click.option("--samples", type=click.IntRange(min=1), default=20_000, show_default=True)
@click.option("--workers", "--split-workers", "workers", type=click.IntRange(min=1), help="Dask workers (default: one per core).")
@click.option("--steps", type=click.IntRange(min=1), help="Training steps (default 600; 40 per run under the WAN rehearsal).")
@click.option("--train/--no-train", default=True, help="--no-train: synthesize and split only.")
@click.option(
    "--wan",
    "wan",
    default="auto",
    show_default=True,
    metavar="auto|off|MATRIX",
    help="Train under the WAN rehearsal: auto (the demo's matrix when run as root), off, or a matrix file (TOML).",
)
def demo(out: Path, samples: int, workers: int | None, steps: int | None, train: bool, wan: str) -> None:
    """The main job on one machine: synthesize, split for three regions, sync to a local S3
    server, train one DDP job across the three regions (one rank each), each reading its own
    region's tier chain, and report the IO wait; as root, every packet between regions crosses
    the WAN rehearsal's links, and the same samples are trained again with DiLoCo, side by side."""
    from geoshard.cli.progress import split_progress, split_table
    from geoshard.cli.report import render_report
    from geoshard.local.demo import DemoSettings, run_demo, side_by_side

    quiet_dask()
    click.echo(f"geoshard demo: {samples:,} synthetic samples -> three regions under {out}/")
    matrix = _demo_matrix(wan, out) if train else None
    if steps is None:
        steps = 40 if matrix is not None else 600  # under the WAN each step waits for the ocean, in two runs
    settings = DemoSettings(out=out, samples=samples, workers=workers, steps=steps, train=train, wan=matrix)
    with split_progress() as progress:
        result = run_demo(settings, progress=progress.update, echo=click.echo)
    split_table(result.split)
    if result.report is not None:
        click.echo(render_report(result.report))
    for line in side_by_side(result):
        click.echo(line)
    timing = "  ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
    click.echo(f"plan: {result.plan.path}   split: {out / 'split'}   run: {result.run_dir or '-'}")
    for run in (result.run_dir, result.diloco_run_dir):
        if run is not None:
            wan_part = "; the WAN's latencies" if matrix is not None else ""
            click.echo(f"plot: {run / 'report.png'} (per region: data wait, compute, gradient sync{wan_part})")
    click.echo(f"stages: {timing}")


def _demo_matrix(wan: str, out: Path) -> Path | None:
    """The matrix the demo trains under: None for off (or auto without root)."""
    from geoshard.local.demo import DEMO_WAN
    from geoshard.wan import NeedsRootError, require_root

    if wan == "off":
        return None
    if wan == "auto":
        try:
            require_root()
        except NeedsRootError as e:
            click.echo(f"WAN rehearsal off ({e}); the ranks' traffic between regions stays on loopback")
            return None
        out.mkdir(parents=True, exist_ok=True)
        path = out / "wan.toml"
        path.write_text(DEMO_WAN)
        click.echo(f"running as root: training under the WAN rehearsal ({path}); --wan off to train on loopback")
        return path
    require_root()
    return Path(wan)


class _LazyCommands(MutableMapping[str, click.Command]):
    """``main.commands`` with the commands of other modules imported on first use: ``geoshard
    split`` imports neither the sync, train, report and WAN modules nor what they import (numpy
    is already there; rich tables, torch options, s5cmd, boto3 are not), while ``--help`` and
    anything that walks ``main.commands`` still see every command."""

    def __init__(self, loaded: MutableMapping[str, click.Command], lazy: dict[str, str]) -> None:
        self.loaded = dict(loaded)
        self.lazy = dict(lazy)  # name -> "module:attribute"

    def __getitem__(self, name: str) -> click.Command:
        if name not in self.loaded and name in self.lazy:
            module, attr = self.lazy.pop(name).split(":")
            command = getattr(importlib.import_module(module), attr)
            name_envvars(click.Group(commands={name: command}))  # GEOSHARD_<COMMAND>_<OPTION>, as for the others
            self.loaded[name] = command
        return self.loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self.lazy.pop(name, None)
        self.loaded[name] = command

    def __delitem__(self, name: str) -> None:
        if self.lazy.pop(name, None) is None:
            del self.loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*self.loaded, *self.lazy])

    def __len__(self) -> int:
        return len(self.loaded) + len(self.lazy)

    def __contains__(self, name: object) -> bool:
        return name in self.loaded or name in self.lazy


LAZY_COMMANDS = {
    "sync": "geoshard.cli.sync:sync",
    "pull": "geoshard.cli.sync:pull",
    "refresh": "geoshard.cli.sync:refresh",
    "probe": "geoshard.cli.sync:probe",
    "train": "geoshard.cli.train:train",
    "simulate": "geoshard.cli.simulate:simulate",
    "plan": "geoshard.cli.plan:plan",
    "report": "geoshard.cli.report:report",
    "wan": "geoshard.cli.wan:wan",
    "s3": "geoshard.cli.s3:s3",
}


def _register() -> None:
    name_envvars(main)  # main's own options and the commands defined above
    main.commands = _LazyCommands(main.commands, LAZY_COMMANDS)


_register()

if __name__ == "__main__":  # pragma: no cover
    main()
