"""The one place geoshard reads the process environment.

Everything else receives the values as arguments, so tests and library users never depend on
what happens to be exported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Environment:
    endpoint_url: str | None = None
    region: str | None = None
    geoshard_region: str | None = None
    source_date_epoch: int | None = None  # reproducible-builds convention: fixes manifest timestamps
    timeout_s: float | None = None  # GEOSHARD_TIMEOUT: bound on each S3 request of split, sync, pull, probe, refresh
    gloo_ifname: str | None = None  # GLOO_SOCKET_IFNAME: where the DiLoCo p2p exchange's gloo sockets bind

    def __repr__(self) -> str:  # never print credentials; this class holds none on purpose
        return f"Environment(endpoint_url={self.endpoint_url!r}, region={self.region!r})"


def read_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Snapshot the variables geoshard honours. Credentials stay with the AWS SDK chain."""
    env = os.environ if environ is None else environ
    return Environment(
        endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        geoshard_region=env.get("GEOSHARD_REGION") or None,
        source_date_epoch=_int_or_none(env.get("SOURCE_DATE_EPOCH")),
        timeout_s=_seconds(env.get("GEOSHARD_TIMEOUT"), "GEOSHARD_TIMEOUT"),
        gloo_ifname=env.get("GLOO_SOCKET_IFNAME") or None,
    )


def _seconds(v: str | None, name: str) -> float | None:
    from geoshard.errors import ConfigError

    if not v:
        return None
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if not 0 < s < float("inf"):
        raise ConfigError(f"{name}: must be a number of seconds > 0, got {v!r}")
    return s


def _int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v else None
    except ValueError:
        return None
