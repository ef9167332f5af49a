"""The userspace forwarder: moves IPv4 packets between the regions' TUN devices, late and paced.

Run as ``python -m geoshard.wan.forwarder`` by :class:`geoshard.wan.rehearsal.Rehearsal`, which
passes it one TUN file descriptor per region and talks to it in JSON lines on stdin/stdout:

- first line: ``{"owner": PID, "regions": [{"fd": N, "address": "198.18.0.1"}, ...], "links": [...]}``
- ``{"op": "links", "links": [...]}``: new link parameters (the ceiling is measured with none)
- ``{"op": "counters"}``: per directed pair, bytes and packets delivered and packets dropped
- ``{"op": "stop"}`` or end of input: exit

A link entry is ``{"src": i, "dst": j, "latency_s": x, "rate": bytes_per_s|null, "burst": bytes,
"queue_s": y}`` for the directed pair i→j. Each packet read from region i's device is looked up by
its IPv4 destination, paced by the pair's token bucket (GCRA form: it may leave at
``max(now, tat - burst/rate)``, and is dropped when that is more than ``queue_s`` away, which is a
drop-tail buffer of ``queue_s`` at the link's rate), then written to region j's device
``latency_s`` after it left. Packets of one pair keep their order. Anything else (not IPv4, an
unknown destination) is dropped and counted.

It exits when its owner dies (a pidfd on the owner's process, checked with every wake-up), so the
TUN devices, which are not persistent, vanish with it even after SIGKILL of the owner.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

READ_BUDGET = 64  # packets read from one device before looking at the others and the clock
MAX_PACKET = 65536


@dataclass
class Pair:
    """One direction of a link: its parameters, its bucket state and its counters."""

    dst_fd: int
    latency_s: float = 0.0
    rate: float | None = None  # bytes per second; None: no cap
    tau: float = 0.0  # bucket depth in seconds at ``rate``
    queue_s: float = 0.1
    tat: float = 0.0  # theoretical arrival time of the next packet (GCRA)
    bytes: int = 0
    packets: int = 0
    dropped: int = 0

    def configure(self, spec: dict[str, Any]) -> None:
        self.latency_s = float(spec.get("latency_s", 0.0))
        rate = spec.get("rate")
        self.rate = None if rate is None else float(rate)
        self.tau = 0.0 if self.rate is None else float(spec.get("burst", 0)) / self.rate
        self.queue_s = float(spec.get("queue_s", 0.1))

    def departure(self, now: float, size: int) -> float | None:
        """When a packet of ``size`` bytes arriving ``now`` may leave, or None when the buffer is full."""
        if self.rate is None:
            return now
        leave = max(now, self.tat - self.tau)
        if leave - now > self.queue_s:
            return None
        self.tat = max(now, self.tat) + size / self.rate
        return leave


@dataclass
class Forwarder:
    fds: list[int]  # one TUN fd per region, in region order
    addresses: list[bytes]  # packed IPv4 address per region
    routes: list[dict[bytes, Pair]] = field(default_factory=list)  # per source region: destination address -> pair
    other_dropped: int = 0
    late_sum: float = 0.0  # how late delayed packets left, against their due time: the forwarder's own error
    late_max: float = 0.0
    late_n: int = 0
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _heap: list[tuple[float, int, int, bytes, Pair]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.routes = [{self.addresses[j]: Pair(dst_fd=self.fds[j]) for j in range(len(self.fds)) if j != i} for i in range(len(self.fds))]

    def pair(self, src: int, dst: int) -> Pair:
        return self.routes[src][self.addresses[dst]]

    def set_links(self, links: list[dict[str, Any]]) -> None:
        for spec in links:
            self.pair(int(spec["src"]), int(spec["dst"])).configure(spec)

    def counters(self) -> list[list[int]]:
        n = len(self.fds)
        return [[i, j, p.bytes, p.packets, p.dropped] for i in range(n) for j in range(n) if j != i for p in [self.pair(i, j)]]

    def drain(self, src: int, now: float) -> None:
        """Read what region ``src`` sent (up to a budget) and schedule or deliver each packet."""
        fd = self.fds[src]
        routes = self.routes[src]
        read = os.read
        for _ in range(READ_BUDGET):
            try:
                pkt = read(fd, MAX_PACKET)
            except BlockingIOError:
                return
            except OSError:
                return
            pair = routes.get(pkt[16:20]) if len(pkt) >= 20 and pkt[0] >> 4 == 4 else None
            if pair is None:
                self.other_dropped += 1
                continue
            leave = pair.departure(now, len(pkt))
            if leave is None:
                pair.dropped += 1
                continue
            due = leave + pair.latency_s
            if due <= now:
                self.deliver(pair, pkt)
            else:
                heapq.heappush(self._heap, (due, next(self._seq), pair.dst_fd, pkt, pair))

    def deliver(self, pair: Pair, pkt: bytes) -> None:
        try:
            os.write(pair.dst_fd, pkt)
        except OSError:
            pair.dropped += 1
            return
        pair.bytes += len(pkt)
        pair.packets += 1

    def release(self, now: float) -> float | None:
        """Deliver every packet that is due; returns when the next one is, or None."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, _, _, pkt, pair = heapq.heappop(heap)
            self.deliver(pair, pkt)
            late = now - due
            self.late_sum += late
            self.late_n += 1
            self.late_max = max(self.late_max, late)
        return heap[0][0] if heap else None


def serve(config: dict[str, Any], control_in: Any, control_out: Any) -> int:
    regions = config["regions"]
    fwd = Forwarder(fds=[int(r["fd"]) for r in regions], addresses=[socket.inet_aton(r["address"]) for r in regions])
    fwd.set_links(config.get("links", []))
    try:
        owner = os.pidfd_open(int(config["owner"]))
    except ProcessLookupError:
        return 0  # the owner died while starting us
    ctl = control_in.fileno()
    by_fd = {fd: i for i, fd in enumerate(fwd.fds)}
    # select(), not epoll: its timeout has microsecond resolution, epoll's whole milliseconds
    # (rounded up); with a handful of descriptors it costs the same.
    watched = [*fwd.fds, ctl, owner]
    buf = b""
    reply(control_out, {"ready": True})
    now = time.monotonic()
    next_due: float | None = None
    while True:
        timeout = None if next_due is None else max(0.0, next_due - now)
        readable, _, _ = select.select(watched, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            src = by_fd.get(fd)
            if src is not None:
                fwd.drain(src, now)
            elif fd == owner:
                return 0  # the owner is gone: exit, and the TUN devices go with us
            else:
                chunk = os.read(ctl, 65536)
                if not chunk:
                    return 0
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    op = msg.get("op")
                    if op == "stop":
                        return 0  # no reply: the owner may have closed its end already
                    if op == "links":
                        fwd.set_links(msg["links"])
                        reply(control_out, {"ok": True})
                    elif op == "counters":
                        late = {"n": fwd.late_n, "sum_s": fwd.late_sum, "max_s": fwd.late_max}
                        reply(control_out, {"pairs": fwd.counters(), "other_dropped": fwd.other_dropped, "late": late})
                    else:
                        reply(control_out, {"error": f"unknown op {op!r}"})
        next_due = fwd.release(time.monotonic())
        now = time.monotonic()


def reply(out: Any, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _realtime() -> None:
    """SCHED_FIFO at the lowest real-time priority: the forwarder's timer is the matrix's accuracy.

    When the cores are busy, an ordinary process is woken late, so delayed packets leave late and
    the matrix's latencies come out long; a real-time one is woken on time (docs/benchmarks.md, WAN
    rehearsal). The loop blocks in select() between packets, and the kernel's real-time throttling
    (a share of each period) bounds it should it ever spin. Without the privilege, fall back to a
    nice of -10."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(-10)


def main() -> int:
    # A Ctrl-C reaches the owner's whole process group; the owner stops us (or we see it die).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    config = json.loads(line)
    if config.get("realtime", True):
        _realtime()
    # The rest of stdin is read unbuffered through the fd (the select loop), so the first line must be alone in the pipe.
    return serve(config, sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
