"""A region's front door to a server of this host: a TCP port on the region namespace's address
that relays to a loopback port of the host namespace.

The demo's S3 server (one SeaweedFS process on 127.0.0.1) then has one endpoint per region, each
living in that region's namespace: a rank reaching its own region's endpoint never crosses the
rehearsal's links; a rank reaching another region's endpoint crosses them like any other packet
between regions. The listening socket is made inside the namespace (``netns.inside`` switches
only the calling thread, and a socket stays in the namespace it was made in); accepting and
relaying run in ordinary threads of the host namespace.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
from collections.abc import Callable
from types import TracebackType

from geoshard.wan import netns

log = logging.getLogger(__name__)
_CHUNK = 256 * 1024
CONNECT_TIMEOUT_S = 5.0


class Portal:
    def __init__(self, namespace: str, address: str, target: tuple[str, int]) -> None:
        self.namespace, self.address, self.target = namespace, address, target
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        assert self._listener is not None, "start() first"
        return int(self._listener.getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start(self) -> Portal:
        with netns.inside(self.namespace):
            listener = socket.create_server((self.address, 0), backlog=128)
        listener.settimeout(0.2)  # so stop() is noticed
        self._listener = listener
        threading.Thread(target=self._accept, name=f"portal-{self.address}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.close()
            self._conns.clear()

    def __enter__(self) -> Portal:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
            except OSError as e:
                log.warning("portal %s: cannot reach %s:%d (%s)", self.address, *self.target, e)
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
            pending = [2]  # pipes of this connection still running; the last one closes both sockets
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b, pending), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, pending: list[int]) -> None:
        try:
            while data := src.recv(_CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)  # a half-close: the other direction may still be talking
        with self._lock:
            pending[0] -= 1
            last = pending[0] == 0
            if last:
                self._conns.discard(src)
                self._conns.discard(dst)
        if last:
            src.close()
            dst.close()


_LOOPBACK_ENDPOINT = re.compile(r'^(\s*endpoint\s*=\s*")http://(127\.0\.0\.1|localhost):(\d+)(/?")', re.MULTILINE)


def localize_endpoints(text: str, namespace: Callable[[str], str], address: Callable[[str], str]) -> tuple[str, list[Portal]]:
    """A plan whose loopback S3 endpoints (a server on this host) each get a portal in their region's
    namespace, so that every region's bucket lives in that region; the rewritten text and the portals
    (started; stop them when done). Endpoints elsewhere are left as they are."""
    out, portals, region = [], [], None
    for line in text.splitlines(keepends=True):
        if m := _REGION_TABLE.match(line):
            region = m.group(2)
        elif line.lstrip().startswith("["):
            region = None
        elif (m := _LOOPBACK_ENDPOINT.match(line)) and region is not None:
            portal = Portal(namespace(region), address(region), ("127.0.0.1", int(m.group(3)))).start()
            portals.append(portal)
            line = _LOOPBACK_ENDPOINT.sub(lambda m, p=portal: f"{m.group(1)}{p.endpoint}{m.group(4)}", line)  # type: ignore[misc]
        out.append(line)
    return "".join(out), portals


_REGION_TABLE = re.compile(r'^\s*\[regions\.("?)([A-Za-z0-9_-]+)\1\]')
