"""Shared fixtures. Server logic lives in tests/servers.py; keep this file to fixture wiring."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers import SeaweedS3


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """One SeaweedFS S3 server (127.0.0.1, free ports, SigV4) for the whole run; stopped at the end.

    servers.py also stops it at interpreter exit, and a watchdog kills it if pytest itself is killed.
    """
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server.start()
    finally:
        server.stop()
