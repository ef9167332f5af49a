"""Measure a running rehearsal from inside its namespaces: TCP round trips and paced throughput.

Both ends live in this process: sockets are made inside the regions' namespaces (``netns.inside``)
and served by threads, so nothing has to be started in the namespaces. Every wait has a bound.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from dataclasses import dataclass

from geoshard.errors import ConfigError
from geoshard.wan import netns
from geoshard.wan.errors import WanError
from geoshard.wan.matrix import WanMatrix
from geoshard.wan.rehearsal import Rehearsal

TIMEOUT = 10.0
CHUNK = 64 * 1024
# A connection waits for the handshake (three one-way delays) within TIMEOUT, with room for the
# queue and the forwarder's lateness; a longer link cannot be measured, only rehearsed.
MAX_LATENCY_MS = 3000.0


def refuse_unmeasurable(matrix: WanMatrix, regions: tuple[str, ...] | None = None) -> None:
    """Refuse, before anything is built, a link whose latency the bounded waits cannot measure."""
    names = matrix.check_regions(regions if regions is not None else matrix.regions)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            latency = matrix.link(a, b).latency_ms
            if latency > MAX_LATENCY_MS:
                raise ConfigError(
                    f"{matrix.path}: link {a} <-> {b}: latency_ms {latency:g} is more than wan check can measure "
                    f"(at most {MAX_LATENCY_MS:g}, its waits being bounded by {TIMEOUT:g} s); "
                    "geoshard train --wan rehearses it as it is"
                )


@dataclass(frozen=True)
class PairCheck:
    a: str
    b: str
    latency_ms: float  # one way, from the matrix
    bandwidth_mbit: float | None
    rtt_ms: float  # median of the measured round trips
    mbit: float | None = None  # measured a→b throughput, when asked

    @property
    def rtt_error(self) -> float:
        expected = 2 * self.latency_ms
        return (self.rtt_ms - expected) / expected if expected else 0.0


def _socket(wan: Rehearsal, region: str) -> socket.socket:
    with netns.inside(wan.netns(region)):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT)
    return s


def _connected(wan: Rehearsal, a: str, b: str) -> tuple[socket.socket, socket.socket]:
    """A TCP connection from region a to region b: (a's end, b's end)."""
    server = _socket(wan, b)
    with server:
        server.bind((wan.address(b), 0))
        server.listen(1)
        client = _socket(wan, a)
        try:
            client.connect(server.getsockname())
            peer, _ = server.accept()
        except OSError as e:
            client.close()
            raise WanError(f"no TCP connection from {a} to {b} within {TIMEOUT:.0f} s: {e}") from e
    peer.settimeout(TIMEOUT)
    return client, peer


def rtt(wan: Rehearsal, a: str, b: str, rounds: int = 5) -> list[float]:
    """Round trips in seconds of a 64-byte TCP echo from a to b (Nagle off), after one warm-up."""
    client, peer = _connected(wan, a, b)
    with client, peer:
        for s in (client, peer):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def echo() -> None:
            with contextlib.suppress(OSError):
                while data := peer.recv(64):
                    peer.sendall(data)

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        out = []
        msg = b"x" * 64
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            client.sendall(msg)
            got = 0
            while got < len(msg):
                chunk = client.recv(64)
                if not chunk:
                    raise WanError(f"echo from {b} closed early")
                got += len(chunk)
            if i:
                out.append(time.perf_counter() - t0)
        client.shutdown(socket.SHUT_WR)
        t.join(TIMEOUT)
    return out


def throughput(wan: Rehearsal, a: str, b: str, seconds: float = 2.0, warmup: float = 0.5) -> float:
    """Bytes per second b receives from a over one TCP stream, counted after ``warmup`` seconds."""
    client, peer = _connected(wan, a, b)
    stop = threading.Event()
    with client, peer:

        def send() -> None:
            data = bytes(CHUNK)
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    client.sendall(data)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        start = time.monotonic()
        counted = 0
        t_count: float | None = None
        try:
            while (now := time.monotonic()) < start + warmup + seconds:
                n = len(peer.recv(1 << 20))
                if n == 0:
                    break
                if now >= start + warmup:
                    if t_count is None:
                        t_count = now
                    else:
                        counted += n
        finally:
            stop.set()
            client.shutdown(socket.SHUT_RDWR)
            t.join(TIMEOUT)
        if t_count is None:
            raise WanError(f"nothing arrived from {a} at {b} within {warmup + seconds:.1f} s")
        return counted / (time.monotonic() - t_count)


def check(wan: Rehearsal, rounds: int = 5, throughput_s: float = 0.0) -> list[PairCheck]:
    out = []
    for i, a in enumerate(wan.regions):
        for b in wan.regions[i + 1 :]:
            link = wan.matrix.link(a, b)
            rtts = rtt(wan, a, b, rounds)
            rate = throughput(wan, a, b, throughput_s) * 8 / 1e6 if throughput_s > 0 else None
            out.append(
                PairCheck(
                    a=a,
                    b=b,
                    latency_ms=link.latency_ms,
                    bandwidth_mbit=link.bandwidth_mbit,
                    rtt_ms=statistics.median(rtts) * 1000,
                    mbit=rate,
                )
            )
    return out
