"""bench/netproxy.py: latency is a pipeline delay each way, the cap is shared, cut/restore work.

The servers behind the proxy are tiny threaded TCP servers on 127.0.0.1 started here: an echo
server, and a "source" that answers an 8-byte length N with N bytes (or, for N = 0, reads to EOF
and answers with the count it got, so uploads can be timed too).
"""

from __future__ import annotations

import socket
import socketserver
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from netproxy import NetProxy

MB = 10**6
_BLOB = bytes(range(256)) * (10 * MB // 256 + 1)


class _Quiet(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # resets from cut() are expected; the client side asserts what matters


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _Source(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        (n,) = struct.unpack("!Q", _recv_exact(self.request, 8))
        if n:
            view = memoryview(_BLOB)
            while n:
                k = min(n, 1 << 20)
                self.request.sendall(view[:k])
                n -= k
        else:
            got = 0
            while chunk := self.request.recv(1 << 20):
                got += len(chunk)
            self.request.sendall(struct.pack("!Q", got))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _serve(handler: type[socketserver.BaseRequestHandler]) -> Iterator[int]:
    server = _Quiet(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        t.join()


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    yield from _serve(_Echo)


@pytest.fixture(scope="module")
def source_port() -> Iterator[int]:
    yield from _serve(_Source)


def _download(port: int, n: int) -> float:
    """Seconds from sending the request to the last of ``n`` bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.perf_counter()
        s.sendall(struct.pack("!Q", n))
        _recv_exact(s, n)
        return time.perf_counter() - t0


def _upload(port: int, n: int) -> float:
    """Seconds from the first byte sent to the server's acknowledgement of all ``n``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.perf_counter()
        s.sendall(struct.pack("!Q", 0))
        s.sendall(memoryview(_BLOB)[:n])
        s.shutdown(socket.SHUT_WR)
        (got,) = struct.unpack("!Q", _recv_exact(s, 8))
        assert got == n
        return time.perf_counter() - t0


def _echo_rtt(sock: socket.socket, payload: bytes = b"ping" * 25) -> float:
    t0 = time.perf_counter()
    sock.sendall(payload)
    assert _recv_exact(sock, len(payload)) == payload
    return time.perf_counter() - t0


@pytest.mark.parametrize("latency", [0.03, 0.075])
def test_round_trip_is_twice_the_latency(echo_port: int, latency: float) -> None:
    with NetProxy("127.0.0.1", echo_port, latency_s=latency) as link, socket.create_connection(("127.0.0.1", link.port), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = [_echo_rtt(s) for _ in range(5)]
    rtt = statistics.median(rtts)
    assert min(rtts) >= 2 * latency, rtts  # never early: delivery waits for each chunk's due time
    assert rtt < 2 * latency + 0.06, rtts


@pytest.mark.parametrize("direction", ["down", "up"])
def test_bulk_transfer_runs_at_the_cap_not_at_chunk_per_latency(source_port: int, direction: str) -> None:
    latency, cap, n = 0.05, 20 * MB, 10 * MB
    with NetProxy("127.0.0.1", source_port, latency_s=latency, rate=cap) as link:
        elapsed = (_download if direction == "down" else _upload)(link.port, n)
        stats = link.stats()
    # Request one way, the stream, the last byte (or the acknowledgement) back: 2 latencies + n / cap.
    # A stop-and-wait link (a ~40 KB read per 50 ms) would take over 10 s here.
    rate = n / (elapsed - 2 * latency)
    assert 0.75 * cap <= rate <= 1.25 * cap, f"{direction}: {elapsed:.3f} s, {rate / MB:.1f} MB/s"
    assert elapsed < n / cap + 2 * latency + 0.25
    assert (stats.bytes_down if direction == "down" else stats.bytes_up) >= n


def test_parallel_connections_share_the_cap(source_port: int) -> None:
    latency, cap, n = 0.02, 20 * MB, 5 * MB
    with NetProxy("127.0.0.1", source_port, latency_s=latency, rate=cap) as link, ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        times = list(pool.map(lambda _: _download(link.port, n), range(2)))
        total = time.perf_counter() - t0
    aggregate = 2 * n / (total - 2 * latency)
    assert 0.75 * cap <= aggregate <= 1.25 * cap, f"{total:.3f} s for 2 x {n} B: {aggregate / MB:.1f} MB/s"
    # Each had about half the link the whole time, so both finish together (not one after the other).
    assert min(times) > 0.8 * max(times), times


def test_cut_drops_connections_and_refuses_new_ones_until_restore(echo_port: int) -> None:
    with NetProxy("127.0.0.1", echo_port, latency_s=0.01) as link:
        port = link.port
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            _echo_rtt(s)
            link.cut()
            assert link.is_cut
            s.settimeout(2)
            t0 = time.perf_counter()
            try:
                s.sendall(b"x")
                dropped = s.recv(10) == b""
            except ConnectionError:
                dropped = True
            assert dropped and time.perf_counter() - t0 < 1
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        link.restore()
        assert link.port == port and not link.is_cut
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            assert _echo_rtt(s) >= 0.02
        assert link.stats().connections == 2


def test_target_down_closes_the_client_connection() -> None:
    from servers import closed_port

    with NetProxy("127.0.0.1", closed_port()) as link, socket.create_connection(("127.0.0.1", link.port), timeout=5) as s:
        try:
            closed = s.recv(10) == b""
        except ConnectionError:
            closed = True
        assert closed


@pytest.mark.parametrize("host", ["10.1.2.3", "example.com", "0.0.0.0"])  # noqa: S104 - must be refused
def test_only_loopback_addresses(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        NetProxy(host, 80)
    with pytest.raises(ValueError, match="loopback"):
        NetProxy("127.0.0.1", 80, listen_host=host)


def test_cli_prints_its_address_and_forwards(echo_port: int) -> None:
    script = Path(__file__).resolve().parents[1] / "bench" / "netproxy.py"
    cmd = [sys.executable, str(script), "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{echo_port}", "--latency-ms", "20"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("listening on 127.0.0.1:"), line
            port = int(line.split()[2].rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert _echo_rtt(s) >= 0.04
        finally:
            proc.terminate()
            proc.wait(5)
        assert proc.returncode == 0
