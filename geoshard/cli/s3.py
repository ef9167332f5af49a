"""``geoshard s3 serve``: a local S3 server (SeaweedFS, the ``demo`` extra) for a user's own plan,
in the foreground until Ctrl-C, with its data kept in a folder."""

from __future__ import annotations

import contextlib
import re
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import click

from geoshard.errors import ConfigError, StorageError
from geoshard.local.ports import port_in_use
from geoshard.local.seaweed import SeaweedS3, ServerError, saved_keys, weed_binary

DEFAULT_PORT = 8333  # SeaweedFS's own S3 port: the printed lines stay the same from run to run
# S3's bucket naming rules (3-63 characters, lowercase letters, digits, dots and hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@click.group()
def s3() -> None:
    """A local S3 server for your own plan (SeaweedFS, the demo extra)."""


@s3.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--buckets", default="", metavar="A,B", help="Buckets to create (comma-separated); existing ones are kept.")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True, help="S3 port on 127.0.0.1.")
def serve(directory: Path, buckets: str, port: int) -> None:
    """Serve S3 on 127.0.0.1 with its data in DIRECTORY until Ctrl-C; print the variables to use.

    A second run on the same DIRECTORY serves the same objects with the same keys."""
    names = _bucket_names(buckets)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory}: is a file, not a folder; pass a folder for the server's data (created if missing)")
    if port_in_use(port):
        raise ConfigError(f"--port {port}: 127.0.0.1:{port} is in use; stop what listens there or pass another --port")
    try:
        weed_binary()
    except ServerError as e:
        raise ConfigError(str(e)) from e
    directory.mkdir(parents=True, exist_ok=True)
    access, secret = saved_keys(directory) or (None, None)
    server = SeaweedS3(directory, access_key=access, secret_key=secret, s3_port=port)
    try:
        with _interrupt_on_signals():
            _run(server, names)
    except KeyboardInterrupt:
        click.echo("stopping the server ...")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        server.stop()
    click.echo(f"stopped; the data stays in {server.root}")


def _run(server: SeaweedS3, names: list[str]) -> None:
    try:
        server.start()
        for name in names:
            server.make_bucket(name)
    except ServerError as e:
        raise StorageError(f"the local S3 server did not start: {e}; its log is {server.log_path}") from e
    _print_usage(server, names)
    while server.running:
        time.sleep(0.5)
    raise StorageError(f"the local S3 server exited on its own; its log is {server.log_path}:\n{server.log_tail(10)}")


def _print_usage(server: SeaweedS3, names: list[str]) -> None:
    click.echo(f"geoshard s3 serve: S3 on {server.endpoint} (127.0.0.1 only), data in {server.root}")
    click.echo(f"buckets: {', '.join(f's3://{n}' for n in names)}" if names else "buckets: none created (--buckets A,B)")
    click.echo("in the shell that runs geoshard split, sync, pull and train (keys generated for this server, kept in its folder):")
    env = {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": server.region,
    }
    for k, v in env.items():
        click.echo(f"export {k}={shlex.quote(v)}")
    click.echo("Ctrl-C stops the server")


def _bucket_names(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if not _BUCKET.match(n) or ".." in n:
            raise ConfigError(f"--buckets: {n!r} is not a bucket name (3-63 characters: lowercase letters, digits, dots, hyphens)")
    return names


@contextlib.contextmanager
def _interrupt_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM stop the server; SIGINT explicitly, since a shell starts background jobs with it ignored."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
