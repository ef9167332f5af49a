"""The Alluxio worker stand-in (tests/alluxio_standin.py) driven by the real alluxio-py 1.0.0 client.

Everything here goes through ``alluxio.AlluxioFileSystem`` itself: listing, status, whole-file and
range reads at page boundaries, not-found, corrupted pages, a worker going down, slow answers. Some
tests pin down client behaviour a loader must work around (no timeouts, silent truncation when a
later page fails, page size taken on trust); their docstrings say so.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from alluxio_standin import DEFAULT_PAGE_SIZE, AlluxioWorkerStandIn, file_id, human_size
from requests.adapters import HTTPAdapter

_root_logger = logging.getLogger()
_root_handlers, _root_level = list(_root_logger.handlers), _root_logger.level
with warnings.catch_warnings():
    # etcd3 0.12's generated *_pb2 modules call protobuf 3.20's deprecated descriptor constructors
    # when imported (alluxio imports etcd3 even for a static worker list).
    warnings.filterwarnings("ignore", message="Call to deprecated create function", category=DeprecationWarning, module=r"etcd3\.")
    alluxio = pytest.importorskip("alluxio", reason="alluxio==1.0.0 (the real Alluxio client) is not installed")
# alluxio_file_system.py runs logging.basicConfig(level=WARN) at import; undo it for the rest of the run.
for _h in [h for h in _root_logger.handlers if h not in _root_handlers]:
    _root_logger.removeHandler(_h)
_root_logger.setLevel(_root_level)

PS = DEFAULT_PAGE_SIZE  # 1 MiB: the client's default ("1MB", parsed as binary), and the worker's
SIZES = {
    "empty.bin": 0,
    "one_byte.bin": 1,
    "one_page.bin": PS,
    "one_page_plus_one.bin": PS + 1,
    "several_pages.bin": 3 * PS + 12345,
}
REGION_A = "shards/region-a"
SMALL = "shards/region-b/shard-000000.tar"  # 40,000 bytes: ten 4 KiB pages for the small-page test
LOG = logging.getLogger("tests.alluxio")


@pytest.fixture(scope="module")
def ufs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("alluxio-ufs")
    rng = random.Random(20240229)
    files = {f"{REGION_A}/{name}": size for name, size in SIZES.items()}
    files |= {f"{REGION_A}/meta/manifest.json": 57, SMALL: 40_000, "shards/region-b/deep/er/leaf.txt": 5, "top.txt": 3}
    for rel, size in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    return root


@pytest.fixture
def worker(ufs: Path) -> Iterator[AlluxioWorkerStandIn]:
    with AlluxioWorkerStandIn(ufs) as w:
        yield w


def make_client(worker: AlluxioWorkerStandIn, **overrides: Any) -> Any:
    return alluxio.AlluxioFileSystem(logger=LOG, **(worker.client_kwargs() | overrides))


@pytest.fixture
def fs(worker: AlluxioWorkerStandIn) -> Iterator[Any]:
    client = make_client(worker)
    try:
        yield client
    finally:
        client.session.close()  # the client has no close(); its pooled requests.Session must be closed


class _TimeoutAdapter(HTTPAdapter):
    """Gives every request of the client's session a timeout (the client itself sets none)."""

    def __init__(self, timeout: float, **kwargs: Any) -> None:
        self._timeout = timeout
        super().__init__(**kwargs)

    def send(self, request: Any, stream: bool = False, timeout: Any = None, **kwargs: Any) -> Any:
        return super().send(request, stream=stream, timeout=self._timeout if timeout is None else timeout, **kwargs)


def set_timeout(client: Any, seconds: float) -> None:
    old = client.session.adapters["http://"]
    client.session.mount("http://", _TimeoutAdapter(seconds, pool_connections=64, pool_maxsize=64))
    old.close()


def local(ufs: Path, rel: str) -> bytes:
    return (ufs / rel).read_bytes()


def causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None:
        chain.append(e)
        e = e.__cause__
    return chain


# ----- configuration, file ids, worker choice --------------------------------------------------------


def test_client_defaults_file_id_and_worker_choice(worker: AlluxioWorkerStandIn, fs: Any) -> None:
    bare = alluxio.AlluxioFileSystem(worker_hosts=worker.host, worker_http_port=worker.port, logger=LOG)
    try:
        assert bare.page_size == PS == 1024 * 1024
    finally:
        bare.session.close()
    assert fs.page_size == worker.page_size
    uri = worker.uri(f"{REGION_A}/one_byte.bin")
    assert fs._get_path_hash(uri) == file_id(uri) == hashlib.sha256(uri.encode()).hexdigest()
    assert fs._get_preferred_worker_address(uri) == (worker.host, worker.port)
    fs.read(uri)
    assert worker.requests == [("GET", f"/v1/file/{file_id(uri)}/page/0")]


def test_human_readable_size_matches_alluxio_format() -> None:
    assert [human_size(n) for n in (0, 1, 5120, 5121, 77542, PS, 6 * PS)] == [
        "0B",
        "1B",
        "5120B",
        "5.00KB",
        "75.72KB",  # the example in alluxio-py's own docstring
        "1024.00KB",
        "6.00MB",
    ]


# ----- (a) listing, (b) status -----------------------------------------------------------------------


def test_listdir_folders_and_nested(worker: AlluxioWorkerStandIn, fs: Any, ufs: Path) -> None:
    top = fs.listdir(worker.uri())
    assert [(s.type, s.name) for s in top] == [("directory", "shards"), ("file", "top.txt")]
    assert [(s.type, s.name) for s in fs.listdir(worker.uri("shards"))] == [("directory", "region-a"), ("directory", "region-b")]

    entries = fs.listdir(worker.uri(REGION_A))
    assert [s.name for s in entries] == sorted([*SIZES, "meta"])
    by_name = {s.name: s for s in entries}
    meta = by_name["meta"]
    assert (meta.type, meta.length, meta.human_readable_file_size) == ("directory", 0, "0B")
    for name, size in SIZES.items():
        s = by_name[name]
        assert s.type == "file"
        assert s.length == size
        assert s.human_readable_file_size == human_size(size)
        assert s.path == f"/{REGION_A}/{name}"
        assert s.ufs_path == worker.uri(f"{REGION_A}/{name}")
        assert s.last_modification_time_ms == int((ufs / REGION_A / name).stat().st_mtime * 1000)

    deep = fs.listdir(worker.uri("shards/region-b/deep/er"))
    assert [(s.name, s.length) for s in deep] == [("leaf.txt", 5)]
    # A file lists as itself, as Alluxio's listStatus does.
    assert [s.name for s in fs.listdir(worker.uri("top.txt"))] == ["top.txt"]
    assert worker.counts["files"] == 5
    assert all(q.startswith("/v1/files?path=s3%3A%2F%2Fgeoshard-standin") for _, q in worker.requests)


def test_file_status(worker: AlluxioWorkerStandIn, fs: Any) -> None:
    for name, size in SIZES.items():
        st = fs.get_file_status(worker.uri(f"{REGION_A}/{name}"))
        assert (st.type, st.name, st.length) == ("file", name, size)
        assert st.ufs_path == worker.uri(f"{REGION_A}/{name}")
    d = fs.get_file_status(worker.uri("shards/region-b"))
    assert (d.type, d.name, d.path, d.length) == ("directory", "region-b", "/shards/region-b", 0)
    assert worker.counts["info"] == len(SIZES) + 1
    assert set(worker.counts) == {"info"}


# ----- (c) whole files and ranges at page boundaries -------------------------------------------------


@pytest.mark.parametrize("name", list(SIZES))
def test_read_whole_file(worker: AlluxioWorkerStandIn, fs: Any, ufs: Path, name: str) -> None:
    size = SIZES[name]
    assert fs.read(worker.uri(f"{REGION_A}/{name}")) == local(ufs, f"{REGION_A}/{name}")
    # read() asks for full pages until one comes back short; a size that is a whole number of pages
    # (one_page.bin) costs one more request, for the page past the end, whose failure ends the file.
    assert worker.counts["page"] == (1 if size == 0 else size // PS + 1)
    assert all("?" not in q for _, q in worker.requests)  # full pages carry no offset/length


RANGES = [
    (0, 1),
    (PS - 1, 1),
    (PS - 1, 2),  # straddles the first boundary
    (PS, 1),
    (PS, PS),  # exactly the second page
    (PS - 5, PS + 10),  # three pages: tail, whole, head
    (2 * PS + 7, 100),
    (0, 3 * PS + 12345),  # the whole file
    (3 * PS + 12344, 1),  # the last byte
]


def test_read_range_at_page_boundaries(worker: AlluxioWorkerStandIn, fs: Any, ufs: Path) -> None:
    rel = f"{REGION_A}/several_pages.bin"
    data, uri = local(ufs, rel), worker.uri(rel)
    for offset, length in RANGES:
        got = fs.read_range(uri, offset, length)
        assert got == data[offset : offset + length], (offset, length)
    # Every range read names offset and length per page.
    assert all("?offset=" in q and "&length=" in q for _, q in worker.requests)
    worker.reset_counters()
    fs.read_range(uri, PS - 5, PS + 10)
    fid = file_id(uri)
    assert [q for _, q in worker.requests] == [
        f"/v1/file/{fid}/page/0?offset={PS - 5}&length=5",
        f"/v1/file/{fid}/page/1?offset=0&length={PS}",
        f"/v1/file/{fid}/page/2?offset=0&length=5",
    ]


def test_read_range_edges(worker: AlluxioWorkerStandIn, fs: Any, ufs: Path) -> None:
    several = local(ufs, f"{REGION_A}/several_pages.bin")
    uri = worker.uri(f"{REGION_A}/several_pages.bin")
    # length None or -1: the client asks /v1/info for the size first, then reads to the end.
    assert fs.read_range(uri, PS + 3, None) == several[PS + 3 :]
    assert fs.read_range(uri, 2 * PS, -1) == several[2 * PS :]
    assert worker.counts["info"] == 2
    # A length past the end is cut at the end, silently.
    assert fs.read_range(uri, len(several) - 10, 100) == several[-10:]
    one_page = local(ufs, f"{REGION_A}/one_page.bin")
    assert fs.read_range(worker.uri(f"{REGION_A}/one_page.bin"), PS - 1, 5) == one_page[-1:]
    assert fs.read_range(worker.uri(f"{REGION_A}/one_page_plus_one.bin"), PS, 1) == local(ufs, f"{REGION_A}/one_page_plus_one.bin")[PS:]
    assert fs.read_range(worker.uri(f"{REGION_A}/empty.bin"), 0, None) == b""
    assert fs.read_range(uri, 5, 0) == b""
    with pytest.raises(ValueError):
        fs.read_range(uri, -1, 5)


def test_small_page_size_option(ufs: Path) -> None:
    with AlluxioWorkerStandIn(ufs, page_size=4096) as worker:
        client = make_client(worker)
        try:
            assert client.page_size == 4096
            data = local(ufs, SMALL)
            assert client.read(worker.uri(SMALL)) == data
            assert worker.counts["page"] == 10  # 9 full pages and a short one
            assert client.read_range(worker.uri(SMALL), 4095, 4098) == data[4095 : 4095 + 4098]
        finally:
            client.session.close()


def test_page_size_mismatch_truncates_silently(ufs: Path) -> None:
    """The client takes its page size on trust: if the worker's pages are smaller, the first short
    page looks like the end of the file and read() returns a prefix without an error. The loader
    must pass the worker's alluxio.worker.page.store.page.size and check lengths."""
    with AlluxioWorkerStandIn(ufs, page_size=4096) as worker:
        client = make_client(worker, options={})  # client assumes 1 MiB pages
        try:
            assert client.read(worker.uri(SMALL)) == local(ufs, SMALL)[:4096]
        finally:
            client.session.close()


# ----- (d) not found ---------------------------------------------------------------------------------


@pytest.mark.parametrize("errors", ["close", "http"])
def test_missing_path(worker: AlluxioWorkerStandIn, fs: Any, errors: str) -> None:
    """Not-found is a plain Exception from every call (never FileNotFoundError); its cause is the
    dropped connection (as a real worker answers) or the HTTP error status."""
    worker.errors = errors
    cause = requests.ConnectionError if errors == "close" else requests.HTTPError
    missing = worker.uri("shards/nope.bin")
    calls = {
        "get_file_status": lambda: fs.get_file_status(missing),
        "listdir": lambda: fs.listdir(missing),
        "read": lambda: fs.read(missing),
        "read_range": lambda: fs.read_range(missing, 0, 10),
        "read_range_to_end": lambda: fs.read_range(missing, 0, None),
    }
    for what, call in calls.items():
        with pytest.raises(Exception) as info:
            call()
        assert type(info.value) is Exception, what
        assert any(isinstance(c, cause) for c in causes(info.value)), (what, causes(info.value))
    # A URI outside the served prefix is as missing as any other.
    with pytest.raises(Exception, match="Error when getting file status"):
        fs.get_file_status("gs://elsewhere/x")
    # And the same client still works afterwards.
    assert fs.get_file_status(worker.uri("top.txt")).length == 3


# ----- (e) corruption --------------------------------------------------------------------------------


def test_corrupt_pages_differ_but_keep_length(worker: AlluxioWorkerStandIn, fs: Any, ufs: Path) -> None:
    rel = f"{REGION_A}/several_pages.bin"
    good = local(ufs, rel)
    worker.corrupt = True
    bad = fs.read(worker.uri(rel))
    assert len(bad) == len(good) and bad != good
    assert hashlib.sha256(bad).digest() != hashlib.sha256(good).digest()
    assert sum(a != b for a, b in zip(bad, good, strict=True)) == 4  # one byte per page
    assert fs.read_range(worker.uri(rel), 10, 100) != good[10:110]
    assert fs.read(worker.uri(f"{REGION_A}/empty.bin")) == b""  # nothing to flip
    worker.corrupt = False
    assert fs.read(worker.uri(rel)) == good


def test_later_page_failure_truncates_silently(worker: AlluxioWorkerStandIn, fs: Any, ufs: Path) -> None:
    """An error on the first page raises, an error on any later page just ends the data: read() and
    read_range() return a prefix with no error. A loader must compare lengths with the status (or a
    manifest) and verify checksums."""
    rel = f"{REGION_A}/several_pages.bin"
    data, uri = local(ufs, rel), worker.uri(rel)
    worker.fail_page_from = 2
    assert fs.read(uri) == data[: 2 * PS]
    assert fs.read_range(uri, PS - 1, 3 * PS) == data[PS - 1 : 2 * PS]
    worker.fail_page_from = 0
    with pytest.raises(Exception, match="Error when reading file"):
        fs.read(uri)


# ----- (f) worker down, (g) slow worker --------------------------------------------------------------


def test_down_fails_fast_and_up_recovers(worker: AlluxioWorkerStandIn, fs: Any, ufs: Path) -> None:
    uri = worker.uri(f"{REGION_A}/one_byte.bin")
    assert fs.read(uri) == local(ufs, f"{REGION_A}/one_byte.bin")  # leaves a pooled keep-alive connection
    worker.down()
    timings = {}
    for what, call in {
        "get_file_status": lambda: fs.get_file_status(uri),
        "read": lambda: fs.read(uri),
        "read_range": lambda: fs.read_range(uri, 0, 1),
        "listdir": lambda: fs.listdir(worker.uri()),
    }.items():
        t0 = time.perf_counter()
        with pytest.raises(Exception) as info:
            call()
        timings[what] = time.perf_counter() - t0
        assert "Connection refused" in str(info.value) or "Max retries exceeded" in str(info.value), info.value
    print(f"\nalluxio client against a down worker (refused): {', '.join(f'{k} {v * 1000:.1f} ms' for k, v in timings.items())}")
    assert max(timings.values()) < 2.0, timings  # refused connections: no wait, no retry
    worker.up()
    assert fs.get_file_status(uri).length == 1


def test_delay_without_timeout_just_waits(worker: AlluxioWorkerStandIn, fs: Any) -> None:
    """The client passes no timeout to requests: a slow worker is waited for, however slow."""
    worker.delay_s = 1.0
    t0 = time.perf_counter()
    assert fs.get_file_status(worker.uri("top.txt")).length == 3
    assert time.perf_counter() - t0 >= 1.0


def test_delay_with_session_timeout_fails_in_bounded_time(worker: AlluxioWorkerStandIn, fs: Any) -> None:
    """The only way to bound a call: give the client's requests.Session an adapter with a timeout."""
    set_timeout(fs, 0.3)
    worker.delay_s = 30.0  # cut short by worker.stop() at teardown
    for call in (lambda: fs.get_file_status(worker.uri("top.txt")), lambda: fs.read(worker.uri("top.txt"))):
        t0 = time.perf_counter()
        with pytest.raises(Exception) as info:
            call()
        elapsed = time.perf_counter() - t0
        assert any(isinstance(c, requests.ReadTimeout) for c in causes(info.value)), causes(info.value)
        assert 0.3 <= elapsed < 1.5, elapsed
    worker.delay_s = 0.0
    assert fs.get_file_status(worker.uri("top.txt")).length == 3


# ----- load, write_page, counters --------------------------------------------------------------------


def test_cached_only_needs_load(ufs: Path) -> None:
    """A real worker serves only cached pages; load() (GET /v1/load submit, then progress) first."""
    with AlluxioWorkerStandIn(ufs, cached_only=True) as worker:
        client = make_client(worker)
        try:
            uri = worker.uri("shards/region-b/deep/er/leaf.txt")
            with pytest.raises(Exception, match="Error when reading file"):
                client.read(uri)
            assert client.get_file_status(uri).length == 5  # metadata needs no load
            assert client.load(worker.uri("shards/region-b")) is True
            assert client.read(uri) == local(ufs, "shards/region-b/deep/er/leaf.txt")
            assert client.load_progress(worker.uri("shards/region-b"))[0].value == "SUCCEEDED"
            assert worker.counts["load"] == 3  # submit, progress, progress
        finally:
            client.session.close()


def test_write_page_then_read(worker: AlluxioWorkerStandIn, fs: Any) -> None:
    uri = worker.uri("written/page.bin")
    assert fs.write_page(uri, 0, b"written through the client") is True
    assert fs.read(uri) == b"written through the client"
    assert worker.counts["write_page"] == 1 and worker.counts["page"] == 1
    assert worker.requests[0] == ("POST", f"/v1/file/{file_id(uri)}/page/0")


def test_counters_per_endpoint(worker: AlluxioWorkerStandIn, fs: Any) -> None:
    fs.listdir(worker.uri())
    fs.get_file_status(worker.uri("top.txt"))
    fs.read(worker.uri("top.txt"))
    fs.read_range(worker.uri("top.txt"), 1, None)
    assert dict(worker.counts) == {"files": 1, "info": 2, "page": 2}
    worker.reset_counters()
    assert not worker.counts and not worker.requests
