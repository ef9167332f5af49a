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


@pytest.fixture
def aws(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedS3]:
    """The session server's credentials in this process's environment (s5cmd and Dask workers
    inherit it); no default endpoint, so plans and options must name theirs."""
    for k, v in s3.env(endpoint=False).items():
        monkeypatch.setenv(k, v)
    for k in (*SeaweedS3.UNSET_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    yield s3
