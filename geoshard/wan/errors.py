"""The rehearsal's errors: both are GeoshardErrors, so the CLI prints one line and exits with their code."""

from __future__ import annotations

from geoshard.errors import GeoshardError


class NeedsRootError(GeoshardError):
    """Network namespaces and TUN devices need root (CAP_NET_ADMIN); exit 2 like a usage error."""

    exit_code = 2


class WanError(GeoshardError):
    """Building or running the rehearsal's namespaces, devices or forwarder failed."""

    exit_code = 1
