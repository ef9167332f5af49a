"""A host service made reachable inside a region's namespace: ``Rehearsal.expose``.

The listening socket is made inside the region's namespace (on the region's address); the threads
that accept and connect onward run in the host's, so each accepted connection is joined to
``target`` on the host's loopback. A rank of the same region reaches it locally; a rank of another
region reaches it through the forwarder, behind the pair's latency and cap: one S3 server on the
host serves every region's bucket, each at its own region's address.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
CHUNK = 256 * 1024


class Relay:
    def __init__(self, listener: socket.socket, target: tuple[str, int], name: str) -> None:
        self.listener = listener
        self.target = target
        self.name = name
        self.bytes = [0, 0]  # to the target, back from it
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"wan-relay-{name}", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> Relay:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._join, args=(client,), name=f"wan-relay-{self.name}-conn", daemon=True).start()

    def _join(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT)
        except OSError as e:
            log.warning("relay %s: cannot reach %s:%d: %s", self.name, *self.target, e)
            client.close()
            return
        upstream.settimeout(None)
        client.settimeout(None)
        with self._lock:
            self._conns.update((client, upstream))
        back = threading.Thread(target=self._pump, args=(upstream, client, 1), daemon=True)
        back.start()
        self._pump(client, upstream, 0)
        back.join()
        with self._lock:
            self._conns.difference_update((client, upstream))
        client.close()
        upstream.close()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: int) -> None:
        try:
            while data := src.recv(CHUNK):
                dst.sendall(data)
                self.bytes[direction] += len(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
