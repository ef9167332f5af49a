"""The forwarder's ceiling: what it moves with no delay and no cap, measured when a rehearsal
starts (above it, results measure the forwarder, not the link)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from geoshard.wan import netns

WINDOW_S = 0.4  # seconds per probe (small packets, then large ones)

# Bytes and packets the forwarder delivered so far from the first region to the second.
Delivered = Callable[[], tuple[int, int]]


@dataclass(frozen=True)
class Ceiling:
    """What the forwarder itself moves with no delay and no cap: above this, results measure the forwarder, not the link."""

    packets_per_s: float  # small packets (a 1-byte UDP payload)
    mb_per_s: float  # MTU-sized packets, 10**6 bytes per second

    def __str__(self) -> str:
        return f"forwarder ceiling: {self.packets_per_s:,.0f} packets/s, {self.mb_per_s:,.0f} MB/s ({self.mb_per_s * 8:,.0f} Mbit/s)"


def measure(src: tuple[str, str], dst: tuple[str, str], mtu: int, delivered: Delivered) -> Ceiling:
    """Blast UDP from ``src`` to ``dst`` (each a namespace and its address) with no delay and no cap;
    count what the forwarder delivers."""
    with netns.inside(dst[0]):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with netns.inside(src[0]):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind((dst[1], 0))  # bound, never read: the kernel drops when full, no ICMP back
        tx.bind((src[1], 0))
        tx.setblocking(False)
        dest = rx.getsockname()
        pps, _ = _blast(tx, dest, b"x", delivered)
        _, bps = _blast(tx, dest, bytes(mtu - 28), delivered)
    return Ceiling(packets_per_s=pps, mb_per_s=bps / 1e6)


def _blast(tx: socket.socket, dest: tuple[str, int], payload: bytes, delivered: Delivered) -> tuple[float, float]:
    """Packets and bytes per second delivered while sending ``payload`` for ``WINDOW_S``."""
    before = delivered()
    t0 = time.monotonic()
    end = t0 + WINDOW_S
    send = tx.sendto
    while time.monotonic() < end:
        for _ in range(64):
            try:
                send(payload, dest)
            except OSError:  # the device queue is full (ENOBUFS) or the socket buffer (EAGAIN): the forwarder is behind
                break
    after = delivered()
    dt = time.monotonic() - t0
    return (after[1] - before[1]) / dt, (after[0] - before[0]) / dt
