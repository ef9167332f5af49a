"""A stand-in for an Alluxio worker's HTTP API, written from alluxio-py 1.0.0's client source and
Alluxio's docs and worker source (``alluxio.worker.http.HttpServerHandler``); not Alluxio.

It serves a local folder as the "UFS" under a made-up URI prefix (``s3://geoshard-standin`` unless
told otherwise) through exactly the endpoints that ``alluxio.AlluxioFileSystem`` (alluxio==1.0.0)
calls, on 127.0.0.1 and a free port:

``GET /v1/files?path=<full UFS URI>``
    JSON list of entries, one per child of a directory (a file lists as itself).
``GET /v1/info?path=<full UFS URI>``
    JSON list holding one entry. Entry fields, as the worker's ``ResponseFileInfo`` writes them and
    the client reads them: ``mType`` ("file" | "directory"), ``mName``, ``mPath`` (path under the
    UFS root, "/a/b"), ``mUfsPath`` (full URI), ``mLastModificationTimeMs`` (int),
    ``mLength`` (int, 0 for directories), ``mHumanReadableFileSize`` ("0B", "75.72KB", ...).
``GET /v1/file/<file id>/page/<n>[?offset=O&length=L]``
    Raw bytes of page n (``page_size`` bytes, the last one shorter), or ``[O, O+L)`` of it.
    The file id is ``sha256(full UFS URI as UTF-8).hexdigest()``, so the worker cannot invert it:
    this stand-in hashes every file under the root (and re-scans on a miss).
``POST /v1/file/<file id>/page/<n>``
    ``write_page``: keeps the body in memory as that page; ``{"success": true, "message": ...}``.
``GET /v1/load?path=<URI>&opType=submit|progress|stop``
    ``{"success", "jobId", "path", "message"}`` for submit/stop, ``{"jobState", "path", "message",
    "respProperties"}`` for progress (a load finishes at once: "SUCCEEDED").

Errors are answered as the real worker answers them: its handler returns no response for a path
that does not exist, a page that is not cached, or an unknown endpoint, and Netty closes the
connection, so the client sees the connection dropped without a status line. ``errors="http"``
answers 404/400 with a JSON body instead (easier to read in a packet log); the client raises the
same generic ``Exception`` either way. Like the worker, the ``path`` parameter is decoded for
``%2F``, ``%3A`` and ``%3F`` only (``decode_all=True`` decodes everything).

A real worker serves only pages that are in its cache (loaded with ``/v1/load`` or written with
``write_page``); by default this stand-in serves every UFS file as if the data set had been loaded.
``cached_only=True`` restores the real rule: pages of a file are served only after a load of it
or of a folder above it (or after ``write_page``).

Knobs for fault tests (plain attributes, read on every request, safe to change while running):
``delay_s`` (sleep before answering any request; cut short by ``down()``/``stop()``),
``corrupt`` (flip one byte in the middle of every non-empty page body, same length),
``fail_page_from`` (page reads with index >= this fail as an uncached page), ``down()`` / ``up()``
(stop listening and drop every open connection; listen again on the same port), and counters of
requests per endpoint (``counts``, ``requests``, ``reset_counters()``).

    with AlluxioWorkerStandIn(tmp_path) as worker:
        fs = alluxio.AlluxioFileSystem(**worker.client_kwargs())
        fs.read(worker.uri("a/b.bin"))
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

DEFAULT_PAGE_SIZE = 1024 * 1024  # alluxio-py: ALLUXIO_PAGE_SIZE_DEFAULT_VALUE = "1MB", parsed binary
PAGE_SIZE_OPTION = "alluxio.worker.page.store.page.size"
ENDPOINTS = ("files", "info", "page", "write_page", "load", "unknown")


def file_id(ufs_uri: str) -> str:
    """The id alluxio-py puts in page URLs: SHA-256 of the full UFS URI, lower-case hex."""
    return hashlib.sha256(ufs_uri.encode("utf-8")).hexdigest()


def human_size(n: int) -> str:
    """Alluxio's ``FormatUtils.getSizeFromBytes``: "%dB" up to 5 KiB, then "%.2fKB" and so on."""
    if n <= 1024 * 5:
        return f"{n}B"
    value = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1024
        if value <= 1024 * 5:
            return f"{value:.2f}{unit}"
    return f"{value / 1024:.2f}PB"


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # joined by server_close()
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], standin: AlluxioWorkerStandIn) -> None:
        self.standin = standin
        self.conns: set[socket.socket] = set()
        self.conns_lock = threading.Lock()
        super().__init__(addr, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        # Runs in the accept loop, so every accepted socket is known before down() closes them.
        conn, addr = super().get_request()
        with self.conns_lock:
            self.conns.add(conn)
        return conn, addr

    def shutdown_request(self, request: Any) -> None:
        with self.conns_lock:
            self.conns.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        with self.conns_lock:
            conns = list(self.conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's pooled requests.Session expects
    server_version = "AlluxioWorkerStandIn/1"
    timeout = 30  # an idle keep-alive connection is closed after this long
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        standin = self.server.standin
        body = b""
        if method == "POST":
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        route, fields, params = _parse(self.path, standin.decode_all)
        endpoint = _endpoint(method, route, fields)
        standin._count(endpoint, method, self.path)
        if standin.delay_s > 0 and standin._stopping.wait(standin.delay_s):
            self.close_connection = True  # going down while delayed: no answer
            return
        try:
            try:
                status, ctype, payload = standin._answer(endpoint, fields, params, body)
            except (ValueError, OSError) as e:  # a bad page index or offset, an unreadable file
                raise _HttpError(400 if isinstance(e, ValueError) else 500, repr(e)) from e
        except _HttpError as e:
            if standin.errors != "http":
                self.close_connection = True  # the real worker's answer to every error
                return
            status, ctype, payload = e.status, "application/json", json.dumps({"error": str(e)}).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _parse(raw: str, decode_all: bool) -> tuple[str, list[str], dict[str, str]]:
    path, _, query = raw.partition("?")
    parts = [p for p in path.split("/") if p]
    if len(parts) < 2 or parts[0] != "v1":
        return "", parts, {}
    params: dict[str, str] = {}
    if decode_all:
        params = dict(parse_qsl(query, keep_blank_values=True))
    else:  # the worker's HttpRequestUtil: split on & and =, then only %2F, %3A and %3F are decoded
        for pair in query.split("&"):
            key, sep, value = pair.partition("=")
            if sep:
                params[key] = value.replace("%2F", "/").replace("%3A", ":").replace("%3F", "?")
    return parts[1], parts[2:], params


def _endpoint(method: str, route: str, fields: list[str]) -> str:
    if route == "file" and len(fields) == 3 and fields[1] == "page":
        return "write_page" if method == "POST" else "page"
    if method == "GET" and route in ("files", "info", "load"):
        return route
    return "unknown"


class AlluxioWorkerStandIn:
    """One stand-in worker serving ``root`` as the UFS ``ufs_prefix``; see the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        ufs_prefix: str = "s3://geoshard-standin",
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        host: str = "127.0.0.1",
        port: int = 0,
        delay_s: float = 0.0,
        corrupt: bool = False,
        fail_page_from: int | None = None,
        cached_only: bool = False,
        errors: str = "close",
        decode_all: bool = False,
    ) -> None:
        if host != "127.0.0.1":
            raise ValueError("the stand-in binds 127.0.0.1 only")
        if errors not in ("close", "http"):
            raise ValueError("errors must be 'close' (as the real worker) or 'http'")
        if "://" not in ufs_prefix:
            raise ValueError("ufs_prefix must be a URI with a scheme, e.g. s3://bucket/prefix")
        self.root = Path(root).resolve()
        self.ufs_prefix = ufs_prefix.rstrip("/")
        self.page_size = int(page_size)
        self.host = host
        self.port = port
        self.delay_s = delay_s
        self.corrupt = corrupt
        self.fail_page_from = fail_page_from
        self.cached_only = cached_only
        self.errors = errors
        self.decode_all = decode_all
        self.counts: collections.Counter[str] = collections.Counter()
        self.requests: list[tuple[str, str]] = []  # (method, raw path with query), in arrival order
        self.loaded: set[str] = set()  # relative paths ("" = root) loaded with /v1/load submit
        self._lock = threading.Lock()
        self._ids: dict[str, str] = {}  # file id -> relative path
        self._written: dict[str, dict[int, bytes]] = {}  # file id -> page index -> bytes (write_page)
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> AlluxioWorkerStandIn:
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server((self.host, self.port), self)
        self.port = self._server.server_address[1]  # keep it: up() after down() rebinds the same port
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def down(self) -> None:
        """Stop accepting, close the listening socket and drop every open connection (new
        connections are refused). Requests sleeping in ``delay_s`` end without an answer."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.drop_connections()
        server.server_close()  # joins the handler threads
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def up(self) -> AlluxioWorkerStandIn:
        """Listen again on the same port after ``down()``."""
        return self.start()

    stop = down

    @property
    def running(self) -> bool:
        return self._server is not None

    def __enter__(self) -> AlluxioWorkerStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- helpers for tests -----------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def uri(self, rel: str = "") -> str:
        """The full UFS URI the client must be given for a path under ``root``."""
        rel = rel.strip("/")
        return f"{self.ufs_prefix}/{rel}" if rel else self.ufs_prefix

    def client_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for ``alluxio.AlluxioFileSystem`` to use this worker alone: a
        static worker list (no ETCD). The client takes host names only; the port is separate and
        shared by every worker in the list."""
        return {
            "worker_hosts": self.host,
            "worker_http_port": self.port,
            "options": {PAGE_SIZE_OPTION: str(self.page_size)},
        }

    def reset_counters(self) -> None:
        with self._lock:
            self.counts.clear()
            self.requests.clear()

    def _count(self, endpoint: str, method: str, raw: str) -> None:
        with self._lock:
            self.counts[endpoint] += 1
            self.requests.append((method, raw))

    # ----- the API ---------------------------------------------------------------------------

    def _answer(self, endpoint: str, fields: list[str], params: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        if endpoint in ("files", "info"):
            local, rel = self._resolve(params.get("path", ""))
            if endpoint == "info":
                entries = [self._entry(local, rel)]
            elif local.is_dir():
                entries = [self._entry(child, f"{rel}/{child.name}".lstrip("/")) for child in sorted(local.iterdir())]
            else:
                entries = [self._entry(local, rel)]
            return 200, "application/json", json.dumps(entries).encode()
        if endpoint == "page":
            return 200, "text/plain", self._page(fields[0], int(fields[2]), params)
        if endpoint == "write_page":
            with self._lock:
                self._written.setdefault(fields[0], {})[int(fields[2])] = body
            return 200, "application/json", json.dumps({"success": True, "message": "Page written successfully"}).encode()
        if endpoint == "load":
            return 200, "text/plain", self._load(params)
        raise _HttpError(404, "no such endpoint")

    def _resolve(self, uri: str) -> tuple[Path, str]:
        if uri != self.ufs_prefix and not uri.startswith(self.ufs_prefix + "/"):
            raise _HttpError(404, f"not under {self.ufs_prefix}: {uri}")
        rel = uri[len(self.ufs_prefix) :].strip("/")
        local = (self.root / rel).resolve()
        if (local != self.root and self.root not in local.parents) or not local.exists():
            raise _HttpError(404, f"no such path: {uri}")
        return local, rel

    def _entry(self, local: Path, rel: str) -> dict[str, Any]:
        st = local.stat()
        is_dir = local.is_dir()
        length = 0 if is_dir else st.st_size
        return {
            "mType": "directory" if is_dir else "file",
            "mName": local.name if rel else "",
            "mPath": "/" + rel,
            "mUfsPath": self.uri(rel),
            "mLastModificationTimeMs": int(st.st_mtime * 1000),
            "mLength": length,
            "mHumanReadableFileSize": human_size(length),
        }

    def _lookup(self, fid: str) -> str | None:
        with self._lock:
            rel = self._ids.get(fid)
        if rel is not None:
            return rel
        ids = {}
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                rel = Path(dirpath, name).relative_to(self.root).as_posix()
                ids[file_id(self.uri(rel))] = rel
        with self._lock:
            self._ids = ids
        return ids.get(fid)

    def _is_loaded(self, rel: str) -> bool:
        parts = rel.split("/")
        return any("/".join(parts[:i]) in self.loaded for i in range(len(parts) + 1))

    def _page(self, fid: str, index: int, params: dict[str, str]) -> bytes:
        if self.fail_page_from is not None and index >= self.fail_page_from:
            raise _HttpError(404, f"page not found: fileId {fid}, pageIndex {index}")
        with self._lock:
            written = self._written.get(fid, {}).get(index)
        if written is not None:
            data = written
        else:
            rel = self._lookup(fid)
            if rel is None or (self.cached_only and not self._is_loaded(rel)):
                raise _HttpError(404, f"page not found: fileId {fid}, pageIndex {index}")
            path = self.root / rel
            size = path.stat().st_size
            start = index * self.page_size
            if start >= size and not (index == 0 and size == 0):
                raise _HttpError(404, f"page not found: fileId {fid}, pageIndex {index}")
            with path.open("rb") as f:
                f.seek(start)
                data = f.read(min(self.page_size, size - start))
        offset = params.get("offset")
        if offset:
            length = params.get("length")
            o = int(offset)
            data = data[o : o + int(length)] if length else data[o:]
        if self.corrupt and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
        return data

    def _load(self, params: dict[str, str]) -> bytes:
        uri = params.get("path", "")
        op = params.get("opType", "")
        try:
            _local, rel = self._resolve(uri)
        except _HttpError as e:
            if op == "progress":
                return json.dumps({"jobState": "FAILED", "path": uri, "message": str(e), "respProperties": {}}).encode()
            return json.dumps({"success": False, "jobId": "NONE", "path": uri, "message": str(e)}).encode()
        if op == "submit":
            with self._lock:
                self.loaded.add(rel)
            job = str(uuid.uuid4())
            return json.dumps({"success": True, "jobId": job, "path": uri, "message": f"Load '{uri}' is successfully submitted."}).encode()
        if op == "progress":
            state = "SUCCEEDED" if self._is_loaded(rel) else "FAILED"
            return json.dumps(
                {"jobState": state, "path": uri, "message": f"Job State: {state}", "respProperties": {"Job State": state}}
            ).encode()
        if op == "stop":
            return json.dumps({"success": True, "path": uri, "message": f"Load '{uri}' is successfully stopped."}).encode()
        raise _HttpError(400, f"unsupported opType: {op}")
