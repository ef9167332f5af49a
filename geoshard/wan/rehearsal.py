"""A WAN rehearsal on one machine: each region a network namespace, every packet between them
through the forwarder, which delays and paces it as the matrix says.

    with Rehearsal(load_matrix("wan.toml"), regions=("us-east-1", "eu-west-1")) as wan:
        subprocess.run(wan.exec_argv("eu-west-1", ["python", "serve.py", wan.address("eu-west-1")]))

Start-up, in order: remove what earlier crashed runs left; start the watchdog (it removes this
run's namespaces if this process dies, even by SIGKILL); per region, a namespace with loopback up
and a TUN device ``wan0`` holding ``198.18.0.<n>/32`` and a route to each other region; the
forwarder, which now holds the only TUN file descriptors; the forwarder's ceiling, measured with
no delay and no cap (about a second); then the matrix's links. Stopping reverses it: the forwarder
exits (the TUN devices vanish with its descriptors), what still runs inside a namespace gets
SIGTERM, then SIGKILL, and the namespaces are removed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from geoshard.util.procs import terminate, wait_or_kill
from geoshard.wan import ceiling, netns
from geoshard.wan.ceiling import Ceiling
from geoshard.wan.errors import NeedsRootError, WanError
from geoshard.wan.matrix import WanMatrix
from geoshard.wan.relay import Relay

log = logging.getLogger(__name__)

IFNAME = "wan0"
MTU = 65000  # large packets keep the packet rate within what a Python forwarder moves
SUBNET = "198.18.0"  # benchmarking range (RFC 2544), used only inside our namespaces
MAX_REGIONS = 254  # one address each in SUBNET
START_TIMEOUT = 15.0
STOP_GRACE = 2.0
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21  # `ip netns add` mounts the namespace


@dataclass(frozen=True)
class Lateness:
    """How late the forwarder let delayed packets go, against their due time (its timer's error)."""

    packets: int
    mean_ms: float
    max_ms: float


def require_root() -> None:
    """Raise NeedsRootError (exit 2, one line) unless this process may create namespaces and TUN devices.

    It checks the effective capabilities, not the uid: root in a container without CAP_NET_ADMIN
    would otherwise fail later with a less helpful message."""
    if _has_caps(_CAP_NET_ADMIN, _CAP_SYS_ADMIN):
        return
    raise NeedsRootError("the WAN rehearsal needs root (CAP_NET_ADMIN) for network namespaces and TUN devices; run it as root")


def _has_caps(*bits: int) -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return all(eff >> b & 1 for b in bits)


ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def paced_default(allowed: Path = ALLOWED_CC) -> dict[str, str]:
    """BBR in every region's namespace when the host allows a namespace to choose it: the
    benchmarks' figures were measured with it, and docs/diloco.md advises it for hosts that
    exchange across regions (cubic measured about 1.3x slower over these links' buffers). A
    host that does not allow it keeps the kernel's default, and the trainer says which it is."""
    try:
        names = allowed.read_text(encoding="ascii", errors="replace").split()
    except OSError:
        return {}
    return {"net.ipv4.tcp_congestion_control": "bbr"} if "bbr" in names else {}


TCP_IP_HEADERS = 52  # IPv4 and TCP headers with timestamps: a segment's payload is the MTU less these
REAL_MSS = 1500 - TCP_IP_HEADERS  # a real path's payload per segment
RMEM = "net.ipv4.tcp_rmem"
KERNEL_RMEM = 131_072  # Linux's tcp_rmem default: a new connection's receive buffer


def receive_buffer_for_mtu(current: str, mtu: int) -> str | None:
    """The ``tcp_rmem`` that gives a connection's receive buffer as many segments at ``mtu`` as the
    kernel's default gives on a 1,500-byte path (``current``: the namespace's "min default max");
    None where its default already holds them. Linux starts every connection's buffer at the default (131,072
    bytes: a 64 KB window, 45 segments of 1,448 bytes) and grows it as the reader keeps up. At the
    rehearsal's 65,000 MTU that window is one segment, and it grows so slowly that a TCPStore
    client's multi_get of 2 x 2.6 MB over a 220 ms round trip took 9.4, 6.5, 2.1, 1.9 and 1.5 s in
    five rounds, against 1.1-1.3 s from the first at MTU 1,500 (2026-12-07, bench/store_probe.py
    ``--rounds``): a cost of the rehearsal's large packets, not of a real path. The maximum is kept (never lowered)."""
    fields = current.split()
    if len(fields) != 3 or not all(f.isdigit() for f in fields) or mtu <= 1500:
        return None
    low, default, high = (int(f) for f in fields)
    scaled = KERNEL_RMEM * (mtu - TCP_IP_HEADERS) // REAL_MSS
    if scaled <= default:
        return None
    return f"{low} {scaled} {max(high, scaled)}"


class Rehearsal:
    def __init__(
        self,
        matrix: WanMatrix,
        regions: Iterable[str] | None = None,
        *,
        measure_ceiling: bool = True,
        realtime: bool = True,
        mtu: int = MTU,
        sysctls: Mapping[str, str] | None = None,
    ) -> None:
        """``realtime``: run the forwarder at SCHED_FIFO priority 1, which keeps its timer accurate on a busy machine.

        ``mtu``: the regions' interfaces' (the default's 64 KB packets keep the forwarder's packet
        rate low; 1,500 gives a real path's segments, and TCP's initial and restart windows with
        them). ``sysctls``: ``net.*`` settings made in every region's namespace, as a region's hosts
        would have them (a new namespace has the kernel's defaults, not the host's), e.g.
        ``{"net.ipv4.tcp_slow_start_after_idle": "0"}``. Unless they name it, the namespaces use
        BBR where the host allows it (``paced_default``), whatever the host's own default, and
        above a 1,500 MTU a receive buffer of a real path's segments (``receive_buffer_for_mtu``)."""
        self.matrix = matrix
        self._realtime = realtime
        if not 576 <= mtu <= MTU:
            raise WanError(f"rehearsal mtu must be 576-{MTU}, got {mtu}")
        self.mtu = mtu
        self.sysctls = {**paced_default(), **dict(sysctls or {})}
        for key, value in self.sysctls.items():
            netns.check_sysctl(key, value)
        self.regions: tuple[str, ...] = matrix.check_regions(matrix.regions if regions is None else regions)
        if len(self.regions) > MAX_REGIONS:
            raise WanError(f"a rehearsal holds at most {MAX_REGIONS} regions, got {len(self.regions)}")
        self._measure = measure_ceiling
        self._names: dict[str, str] = {}
        self._addresses = {r: f"{SUBNET}.{i + 1}" for i, r in enumerate(self.regions)}
        self._forwarder: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._baseline: dict[tuple[str, str], tuple[int, int, int]] = {}
        self._ceiling: Ceiling | None = None
        self._old_sigterm: Any = None
        self._relays: list[Relay] = []

    # -- what users of the rehearsal need -------------------------------------------------------

    def address(self, region: str) -> str:
        return self._addresses[self._known(region)]

    def netns(self, region: str) -> str:
        if not self._names:
            raise WanError("the rehearsal is not running; use it as a context manager or call start()")
        return self._names[self._known(region)]

    def ifname(self, region: str) -> str:
        self._known(region)
        return IFNAME

    def env(self, region: str) -> dict[str, str]:
        """Variables that make gloo and NCCL use the region's WAN interface (add them to the rank's environment)."""
        ifname = self.ifname(region)
        return {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}

    def exec_argv(self, region: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the region's namespace (``ip netns exec`` execs it: same pid, same environment)."""
        return [netns.ip_binary(), "netns", "exec", self.netns(region), *argv]

    def expose(self, region: str, port: int, host: str = "127.0.0.1") -> tuple[str, int]:
        """Make the host's TCP service ``host:port`` (loopback only) reachable inside ``region``'s namespace.

        Returns the (address, port) to use from any region: the region's own ranks reach it
        locally, other regions' through the forwarder, behind their link to ``region``. One S3
        server on the host can so serve each region's bucket from that region's address.
        """
        if not ipaddress.ip_address(host).is_loopback:
            raise WanError(f"expose: {host} is not a loopback address; the rehearsal reaches nothing outside this host")
        with netns.inside(self.netns(region)):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.address(region), 0))
            listener.listen(128)
        except OSError as e:
            listener.close()
            raise WanError(f"expose: cannot listen in {region}: {e}") from e
        relay = Relay(listener, (host, port), f"{region}-{port}").start()  # its threads run in the host's namespace
        self._relays.append(relay)
        return relay.address

    @property
    def forwarder_pid(self) -> int | None:
        return None if self._forwarder is None else self._forwarder.pid

    @property
    def ceiling(self) -> Ceiling:
        if self._ceiling is None:
            raise WanError("the forwarder ceiling was not measured (Rehearsal(..., measure_ceiling=False), or not started)")
        return self._ceiling

    def counters(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Bytes and packets delivered per directed pair (src, dst) since the matrix took effect."""
        return {k: (b, p) for k, (b, p, _) in self._pairs(since_start=True).items()}

    def set_matrix(self, matrix: WanMatrix) -> None:
        """Apply another matrix's links to the running rehearsal (packets already delayed keep their due time)."""
        matrix.check_regions(self.regions)
        self.matrix = matrix
        self._control({"op": "links", "links": self._links()})

    def lateness(self) -> Lateness:
        late = self._control({"op": "counters"})["late"]
        n = int(late["n"])
        return Lateness(packets=n, mean_ms=late["sum_s"] / n * 1000 if n else 0.0, max_ms=late["max_s"] * 1000)

    def dropped(self) -> dict[tuple[str, str], int]:
        """Packets dropped per directed pair because the link's buffer (queue_ms) was full."""
        return {k: d for k, (_, _, d) in self._pairs(since_start=True).items()}

    # -- lifetime --------------------------------------------------------------------------------

    def __enter__(self) -> Rehearsal:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> Rehearsal:
        require_root()
        if self._names:
            raise WanError("the rehearsal is already running")
        netns.clear_stale()
        existing = set(netns.list_namespaces())
        while True:  # a fresh number per rehearsal: several may run in one process
            seq = secrets.randbelow(1 << 16)
            names = {r: netns.namespace_name(os.getpid(), seq, r) for r in self.regions}
            if not existing & set(names.values()):
                break
        self._names = names
        try:
            self._start_watchdog()
            fds: list[int] = []
            try:
                for r in self.regions:
                    ns = self._names[r]
                    netns.add_namespace(ns)
                    fd, tun = netns.open_tun()
                    fds.append(fd)
                    peers = [self._addresses[p] for p in self.regions if p != r]
                    netns.configure_region(ns, tun, IFNAME, self._addresses[r], peers, self.mtu)
                    for key, value in self.sysctls.items():
                        netns.set_sysctl(ns, key, value)
                    if RMEM not in self.sysctls and (rmem := receive_buffer_for_mtu(netns.get_sysctl(ns, RMEM), self.mtu)):
                        netns.set_sysctl(ns, RMEM, rmem)
                self._start_forwarder(fds)
            finally:
                for fd in fds:
                    os.close(fd)  # the forwarder holds them now; the devices live as long as it does
            if self._measure:
                self._ceiling = self._measure_ceiling()
                log.info("%s", self._ceiling)
            self._control({"op": "links", "links": self._links()})
            self._baseline = self._pairs(since_start=False)
            self._catch_sigterm()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the forwarder, what still runs in the namespaces, and remove them. Idempotent."""
        self._release_sigterm()
        relays, self._relays = self._relays, []
        for relay in relays:
            relay.close()
        fwd, self._forwarder = self._forwarder, None
        if fwd is not None:
            with contextlib.suppress(OSError, ValueError):
                assert fwd.stdin is not None
                fwd.stdin.write(b'{"op": "stop"}\n')
                fwd.stdin.flush()
            _close(fwd.stdin, fwd.stdout)
            wait_or_kill(fwd, 5.0)
        names = list(self._names.values())
        # What still runs inside gets SIGTERM everywhere at once, one grace period in all, then SIGKILL.
        terminate([netns.Inside(n) for n in names], STOP_GRACE)
        errors = []
        for name in names:
            try:
                netns.delete_namespace(name)
            except WanError as e:
                errors.append(str(e))
        self._names = {}
        dog, self._watchdog = self._watchdog, None
        if dog is not None:
            with contextlib.suppress(OSError, ValueError):
                assert dog.stdin is not None
                dog.stdin.write(b"stop\n")  # a normal stop: it finds nothing left and exits (a forked child may hold the pipe open)
                dog.stdin.flush()
            _close(dog.stdin)
            wait_or_kill(dog, 10.0)
            _close(dog.stdout)
        if errors:
            raise WanError(f"could not remove every WAN namespace: {errors[0]}")

    # -- internals -------------------------------------------------------------------------------

    def _known(self, region: str) -> str:
        if region not in self._addresses:
            raise WanError(f"region {region!r} is not part of this rehearsal ({', '.join(self.regions)})")
        return region

    def _links(self, *, calibrate: bool = False) -> list[dict[str, Any]]:
        links = []
        for i, a in enumerate(self.regions):
            for j, b in enumerate(self.regions):
                if i == j:
                    continue
                if calibrate:
                    links.append({"src": i, "dst": j, "latency_s": 0.0, "rate": None})
                    continue
                link = self.matrix.link(a, b)
                rate = link.bytes_per_s
                links.append(
                    {
                        "src": i,
                        "dst": j,
                        "latency_s": link.latency_ms / 1000,
                        "rate": rate,
                        # Two full packets of burst: a token bucket shallower than one packet would stall.
                        "burst": 0 if rate is None else 2 * self.mtu,
                        "queue_s": link.queue_ms / 1000,
                    }
                )
        return links

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(  # noqa: S603 - argv list of our own module and names
            [sys.executable, "-I", "-m", "geoshard.wan.watchdog", str(os.getpid()), *self._names.values()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C or a group kill aimed at us must not stop it
        )
        assert self._watchdog.stdout is not None
        if _readline(self._watchdog.stdout, START_TIMEOUT) != b"watching\n":
            raise WanError(f"the WAN watchdog did not start within {START_TIMEOUT:.0f} s")

    def _start_forwarder(self, fds: list[int]) -> None:
        self._forwarder = subprocess.Popen(
            [sys.executable, "-I", "-m", "geoshard.wan.forwarder"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=fds,
        )
        config = {
            "owner": os.getpid(),
            "realtime": self._realtime,
            "regions": [{"fd": fd, "address": self._addresses[r]} for fd, r in zip(fds, self.regions, strict=True)],
            "links": self._links(calibrate=True),
        }
        if self._exchange(config).get("ready") is not True:
            raise WanError("the WAN forwarder did not start")

    def _control(self, msg: dict[str, Any]) -> dict[str, Any]:
        reply = self._exchange(msg)
        if "error" in reply:
            raise WanError(f"WAN forwarder: {reply['error']}")
        return reply

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            fwd = self._forwarder
            if fwd is None or fwd.stdin is None or fwd.stdout is None:
                raise WanError("the WAN forwarder is not running")
            try:
                fwd.stdin.write(json.dumps(msg).encode() + b"\n")
                fwd.stdin.flush()
            except OSError as e:
                raise WanError(f"the WAN forwarder is gone (exit status {fwd.poll()})") from e
            line = _readline(fwd.stdout, START_TIMEOUT)
            if not line:
                raise WanError(f"the WAN forwarder did not answer (exit status {fwd.poll()})")
            reply: dict[str, Any] = json.loads(line)
            return reply

    def _pairs(self, *, since_start: bool) -> dict[tuple[str, str], tuple[int, int, int]]:
        got = self._control({"op": "counters"})
        out = {}
        for i, j, nbytes, packets, dropped in got["pairs"]:
            key = (self.regions[i], self.regions[j])
            b0, p0, d0 = self._baseline.get(key, (0, 0, 0)) if since_start else (0, 0, 0)
            out[key] = (nbytes - b0, packets - p0, dropped - d0)
        return out

    def _measure_ceiling(self) -> Ceiling:
        a, b = self.regions[0], self.regions[1]

        def delivered() -> tuple[int, int]:
            nbytes, packets, _ = self._pairs(since_start=False)[(a, b)]
            return nbytes, packets

        return ceiling.measure((self._names[a], self._addresses[a]), (self._names[b], self._addresses[b]), self.mtu, delivered)

    def _catch_sigterm(self) -> None:
        # SIGTERM's default kills us without unwinding; as SystemExit it runs stop(). Only when nobody else handles it.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)

    def _release_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _sigterm_to_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _readline(stream: IO[bytes], timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b""


def _close(*streams: IO[bytes] | None) -> None:
    for s in streams:
        if s is not None:
            with contextlib.suppress(OSError):
                s.close()
