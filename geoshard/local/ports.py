"""Ports on this machine: free ones for servers the tests and the demo start, and whether one is taken."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that are free on ``host`` now (held open together so none repeats)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something holds ``host:port`` now (SO_REUSEADDR as weed binds, so TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def closed_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on (for "endpoint is down" tests)."""
    return free_ports(1, host)[0]
