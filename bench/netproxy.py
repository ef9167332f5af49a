"""A TCP proxy on loopback that behaves like a long, narrow link (this kernel has no netem).

Every byte that crosses the proxy, in either direction, arrives ``latency_s`` after it was
read, in order; an optional cap in bytes/s per direction is shared by all connections of the
proxy, like one link between two sites. ``cut()`` drops every connection and refuses new ones
until ``restore()``, for fault tests.

The link is a pipeline, not stop-and-wait: a reader task per direction keeps reading while
earlier data is "in flight" (stamped with its due time in a FIFO), and a writer task hands each
chunk on when its time comes. With a cap, each chunk first books its serialization time on the
direction's shared pacer (a virtual-clock token bucket): it arrives at ``end of its
serialization + latency``, so a stream runs at the cap whatever the latency, and N connections
share the cap. In-flight bytes per direction are bounded by ``window`` (like a TCP window), so
a fast sender cannot make the proxy buffer without limit.

Library use (the loop runs in a background thread)::

    with NetProxy("127.0.0.1", 8333, latency_s=0.075, rate=25e6) as link:
        client = s3_client(link.endpoint, None)

CLI::

    python bench/netproxy.py --listen 127.0.0.1:0 --target 127.0.0.1:8333 --latency-ms 75 --rate-mbps 200

``--rate-mbps`` is in megabits per second (10**6 bit/s, as netem's ``rate 200mbit``); the library
takes bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ipaddress
import logging
import signal
import threading
import urllib.parse
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 32 * 2**20
_READ_MAX = 256 * 2**10
_STREAM_LIMIT = 512 * 2**10  # StreamReader buffer; above _READ_MAX so reads come back full
_PACED_CHUNK_S = 0.002  # a paced read carries ~2 ms of the cap: fine-grained sharing, few wakeups
_PACED_MIN = 4 * 2**10


def _check_loopback(host: str, what: str) -> None:
    if host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{what} {host!r} is not a loopback address; netproxy only links 127.0.0.0/8 or ::1")


def parse_hostport(text: str) -> tuple[str, int]:
    """``127.0.0.1:8333`` or ``[::1]:8333`` into (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class _Pacer:
    """A bandwidth cap as a virtual clock: the time at which the link is free again.

    Booking ``n`` bytes starts when the link is free (or now, if it has been idle) and lasts
    ``n / rate``. No accumulated credit beyond that: an idle link does not earn a burst.
    """

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0

    def book(self, n: int, now: float) -> tuple[float, float]:
        start = max(now, self.free_at)
        self.free_at = start + n / self.rate
        return start, self.free_at


@dataclass
class _Direction:
    """Data of one direction of one connection that has been read but not yet delivered."""

    window: int
    queue: collections.deque[tuple[float, bytes | None]] = field(default_factory=collections.deque)
    inflight: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    space: asyncio.Event = field(default_factory=asyncio.Event)
    last_due: float = 0.0


class _Conn:
    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    def abort(self) -> None:
        for w in (self.client, self.server):
            if w is not None:
                w.transport.abort()


@dataclass(frozen=True)
class ProxyStats:
    connections: int  # accepted since start
    open: int
    bytes_up: int  # client -> target, delivered
    bytes_down: int  # target -> client, delivered


class NetProxy:
    """A delayed, optionally rate-capped TCP link from ``listen_host:port`` to ``target``.

    ``latency_s`` is one-way (a request/response round trip costs at least ``2 * latency_s``);
    ``rate`` is bytes per second per direction, shared by all connections (None: no cap).
    ``start()``/``stop()`` (or ``with``) run the proxy's event loop in a daemon thread.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        latency_s: float = 0.0,
        rate: float | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        _check_loopback(target_host, "target")
        _check_loopback(listen_host, "listen address")
        if latency_s < 0 or (rate is not None and rate <= 0) or window <= 0:
            raise ValueError("netproxy needs latency_s >= 0, rate > 0 (or None) and window > 0")
        self.target_host, self.target_port = target_host, target_port
        self.listen_host = listen_host
        self.latency_s = latency_s
        self.rate = rate
        self.window = window
        self._port = listen_port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._pacers = (_Pacer(rate), _Pacer(rate)) if rate else (None, None)
        self._accepted = 0
        self._bytes = [0, 0]

    @classmethod
    def to_url(cls, url: str, **kw: Any) -> NetProxy:
        """A proxy in front of ``http://host:port`` (e.g. an S3 endpoint); see ``endpoint``."""
        u = urllib.parse.urlsplit(url)
        if u.hostname is None or u.port is None:
            raise ValueError(f"{url!r}: expected http://HOST:PORT")
        return cls(u.hostname, u.port, **kw)

    # -- addresses -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._server is None and self._port == 0:
            raise RuntimeError("netproxy has not been started")
        return self._port

    @property
    def address(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}"

    @property
    def is_cut(self) -> bool:
        return self._server is None

    def stats(self) -> ProxyStats:
        return ProxyStats(self._accepted, len(self._conns), self._bytes[0], self._bytes[1])

    # -- lifecycle (called from any thread but the loop's) --------------------------------------

    def start(self) -> NetProxy:
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=f"netproxy-{self.target_port}", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self._listen())
        except BaseException:
            self.stop()
            raise
        cap = f"{self.rate:.0f} B/s" if self.rate else "none"
        log.info("%s -> %s:%d, %.1f ms each way, cap %s", self.address, self.target_host, self.target_port, self.latency_s * 1e3, cap)
        return self

    def stop(self) -> None:
        """Drop every connection, stop listening, stop the loop and its thread; idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if loop.is_running():
                self._call(self._cut())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._loop = self._thread = None

    def cut(self) -> None:
        """Abort every connection (the peers see a reset) and refuse new ones (connection refused)."""
        self._call(self._cut())

    def restore(self) -> None:
        """Listen again, on the same port."""
        self._call(self._listen())

    def __enter__(self) -> NetProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _call(self, coro: Coroutine[object, object, None]) -> None:
        if self._loop is None:
            coro.close()
            raise RuntimeError("netproxy has not been started")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    # -- on the loop ---------------------------------------------------------------------------

    async def _listen(self) -> None:
        if self._server is not None:
            return
        # Same port on restore: SO_REUSEADDR (asyncio's default on POSIX) lets it rebind at once.
        self._server = await asyncio.start_server(self._handle, self.listen_host, self._port, limit=_STREAM_LIMIT)
        self._port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = [c.task for c in self._conns if c.task is not None]
        for c in list(self._conns):
            c.abort()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()
        # Aborted transports close their sockets in a callback; let it run before anyone stops the loop.
        for _ in range(2):
            await asyncio.sleep(0)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self._server is None:
            # Accepted just before cut() closed the listener: the link is down, drop it too.
            cwriter.transport.abort()
            return
        conn = _Conn(cwriter)
        conn.task = asyncio.current_task()
        self._conns.add(conn)
        self._accepted += 1
        try:
            try:
                sreader, swriter = await asyncio.open_connection(self.target_host, self.target_port, limit=_STREAM_LIMIT)
            except OSError as e:
                log.warning("netproxy: cannot reach %s:%d: %s", self.target_host, self.target_port, e)
                return
            conn.server = swriter
            await asyncio.gather(
                self._pipe(creader, swriter, conn, self._pacers[0], 0),
                self._pipe(sreader, cwriter, conn, self._pacers[1], 1),
            )
        except asyncio.CancelledError:
            # cut()/stop() cancel connections on purpose. The task is asyncio's, started for
            # start_server's callback, and 3.11 logs a traceback when such a task ends cancelled.
            conn.abort()
        finally:
            self._conns.discard(conn)
            for w in (cwriter, conn.server):
                if w is not None and not w.transport.is_closing():
                    w.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Conn, pacer: _Pacer | None, idx: int) -> None:
        d = _Direction(self.window)
        writer = asyncio.create_task(self._deliver(d, dst, idx))
        try:
            await self._read(src, d, pacer)
            await writer
        except (ConnectionError, OSError) as e:
            # One side failed: a real link would carry the reset to the other side; abort both.
            log.debug("netproxy: connection aborted: %s", e)
            conn.abort()
        finally:
            if not writer.done():
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                    await writer

    async def _read(self, src: asyncio.StreamReader, d: _Direction, pacer: _Pacer | None) -> None:
        loop = asyncio.get_running_loop()
        size = _READ_MAX if pacer is None else max(_PACED_MIN, min(_READ_MAX, int(pacer.rate * _PACED_CHUNK_S)))
        while True:
            data = await src.read(size)
            now = loop.time()
            if not data:
                self._enqueue(d, max(now + self.latency_s, d.last_due), None)
                return
            if pacer is None:
                start, due = now, now + self.latency_s
            else:
                start, end = pacer.book(len(data), now)
                due = end + self.latency_s
            self._enqueue(d, max(due, d.last_due), data)
            # Wait until this chunk starts to go out, not until it is through: the next read is
            # then booked back to back with it, so wakeup jitter costs no bandwidth, and each
            # connection holds at most one booking ahead, which keeps the shared cap fair.
            if start > now:
                await asyncio.sleep(start - now)
            while d.inflight >= d.window:
                d.space.clear()
                await d.space.wait()

    @staticmethod
    def _enqueue(d: _Direction, due: float, data: bytes | None) -> None:
        d.queue.append((due, data))
        d.last_due = due
        d.inflight += len(data) if data else 0
        d.arrived.set()

    async def _deliver(self, d: _Direction, dst: asyncio.StreamWriter, idx: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not d.queue:
                d.arrived.clear()
                await d.arrived.wait()
            due = d.queue[0][0]
            now = loop.time()
            if due > now:
                await asyncio.sleep(due - now)
            # Hand on everything that is due by now in one go: fewer syscalls when chunks are small.
            now = loop.time()
            while d.queue and d.queue[0][0] <= now:
                _, data = d.queue.popleft()
                if data is None:
                    if dst.can_write_eof() and not dst.transport.is_closing():
                        dst.write_eof()
                    return
                if dst.transport.is_closing():
                    raise ConnectionResetError("peer closed")
                # Count first: the peer may read the bytes (and stats()) before the next line runs.
                self._bytes[idx] += len(data)
                d.inflight -= len(data)
                dst.write(data)
            d.space.set()
            await dst.drain()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Loopback TCP proxy with one-way latency and a shared bandwidth cap per direction.")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (loopback only; port 0: any free port)")
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to (loopback only)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay added in each direction, ms")
    ap.add_argument("--rate-mbps", type=float, default=None, help="cap per direction in Mbit/s (10**6 bit/s), shared by all connections")
    ap.add_argument("--window-mb", type=float, default=DEFAULT_WINDOW / 2**20, help="in-flight MiB per direction per connection")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        lhost, lport = parse_hostport(args.listen)
        thost, tport = parse_hostport(args.target)
        proxy = NetProxy(
            thost,
            tport,
            latency_s=args.latency_ms / 1e3,
            rate=args.rate_mbps * 1e6 / 8 if args.rate_mbps else None,
            listen_host=lhost,
            listen_port=lport,
            window=int(args.window_mb * 2**20),
        )
    except ValueError as e:
        ap.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with proxy:
        rate = f"{args.rate_mbps:g} Mbit/s per direction" if args.rate_mbps else "no rate cap"
        print(f"listening on {proxy.address} -> {thost}:{tport} ({args.latency_ms:g} ms each way, {rate})", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
