"""The region's Alluxio cache as a tier, through the real client (``alluxio`` 1.0.0 on PyPI,
whose ``AlluxioFileSystem`` talks to Alluxio workers' HTTP API).

Why this client: it is Alluxio's own Python client for the worker HTTP API (listing, status and
page reads), with a static worker list or ETCD discovery. It sets no timeouts, so the tier mounts
an HTTP adapter with one on the client's session; it can return a short read when a later page
fails, which the chain catches with the manifest's size and sha256. A worker answers a path it
does not cache by dropping the connection: that is a miss, while a refused or timed-out
connection is the tier being down.
"""

from __future__ import annotations

import logging
import urllib.parse
import warnings
from typing import Any

from geoshard.loaders.tier import Progress, TierDefaults, TierError, TierMissing

_PAGE_SIZE_OPTION = "alluxio.worker.page.store.page.size"


def _client_class() -> Any:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with warnings.catch_warnings():
        # etcd3's generated protobuf modules, imported by alluxio even for static workers.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"etcd3\.")
        import alluxio
    for h in [h for h in root.handlers if h not in handlers]:  # alluxio calls logging.basicConfig on import
        root.removeHandler(h)
    root.setLevel(level)
    return alluxio.AlluxioFileSystem


def _timeout_adapter(timeout: float) -> Any:
    """A requests HTTPAdapter whose every request carries ``timeout`` (the client sets none)."""
    from requests.adapters import HTTPAdapter

    class Adapter(HTTPAdapter):
        def send(self, request: Any, **kw: Any) -> Any:  # type: ignore[override]
            kw["timeout"] = timeout
            return super().send(request, **kw)

    return Adapter(pool_connections=16, pool_maxsize=16)


# The client warns at every construction that it has no etcd (we name workers directly): quiet it.
_client_log = logging.getLogger(__name__ + ".client")
_client_log.setLevel(logging.ERROR)


class AlluxioTier(TierDefaults):
    kind = "alluxio"

    def __init__(self, url: str, ufs_root: str, region: str = "", timeout_s: float = 2.0, page_size: str | None = None) -> None:
        """``url``: a worker, ``http://host:port`` (several hosts: ``http://h1,h2:port``);
        ``ufs_root``: the UFS URI the shards live under (the region's bucket URL)."""
        u = urllib.parse.urlsplit(url)
        hosts, _, port = u.netloc.rpartition(":")
        if not hosts or not port.isdigit():
            raise TierError(f"alluxio:{region}: worker URL {url!r} must be http://HOST:PORT")
        self.region, self.url, self.ufs_root = region, url, ufs_root.rstrip("/")
        self.name = f"alluxio:{region}" if region else f"alluxio:{url}"
        options = {_PAGE_SIZE_OPTION: page_size} if page_size else {}
        self.fs = _client_class()(worker_hosts=hosts, worker_http_port=int(port), options=options, logger=_client_log)
        adapter = _timeout_adapter(timeout_s)
        self.fs.session.mount("http://", adapter)
        self.fs.session.mount("https://", adapter)

    def close(self) -> None:
        self.fs.session.close()

    def _uri(self, path: str) -> str:
        return f"{self.ufs_root}/{path}"

    def _fail(self, path: str, e: Exception) -> TierError:
        import requests

        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, requests.RequestException):
            cause = cause.__cause__ or cause.__context__
        where = f"{self.name} ({self.url}, {self._uri(path)})"
        if isinstance(cause, requests.Timeout):
            return TierError(f"{where}: timed out")
        if isinstance(cause, requests.HTTPError) and cause.response is not None and cause.response.status_code == 404:
            return TierMissing(f"{where}: not cached")
        if isinstance(cause, requests.ConnectionError):
            text = str(cause)
            if "Connection aborted" in text or "RemoteDisconnected" in text:
                return TierMissing(f"{where}: not cached (the worker closed the connection)")
            return TierError(f"{where}: unreachable")
        return TierError(f"{where}: {type(cause or e).__name__}")

    def stat(self, path: str) -> int | None:
        try:
            return int(self.fs.get_file_status(self._uri(path)).length)
        except Exception as e:  # the client raises bare Exception for everything
            err = self._fail(path, e)
            if isinstance(err, TierMissing):
                return None
            raise err from e

    def read(self, path: str) -> bytes:
        try:
            data: bytes = self.fs.read(self._uri(path))
        except Exception as e:
            raise self._fail(path, e) from e
        return data

    def read_range(self, path: str, offset: int, length: int, progress: Progress | None = None) -> bytes:
        """The client reads pages and returns them together: nothing arrives early, so no ``progress``."""
        try:
            data: bytes = self.fs.read_range(self._uri(path), offset, length)
        except Exception as e:
            raise self._fail(path, e) from e
        return data
