"""Network namespaces and TUN devices for the rehearsal, through iproute2 (argv lists, never a shell).

Names carry the owner's pid, ``geoshard-wan-<pid>-<seq>-<region>``, so a later run can tell what
a crashed one left (its owner is dead) from what a live one uses. Processes inside a namespace are
found by the namespace's inode under /proc and signalled through pidfds, so a pid that was reused
between the scan and the signal is never hit.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from geoshard.util.procs import terminate
from geoshard.wan.errors import WanError

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")  # where `ip netns add` mounts named namespaces
PREFIX = "geoshard-wan-"
_OWNED = re.compile(r"^geoshard-wan-(\d+)-\d+-")
IP_TIMEOUT = 10.0

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000


@functools.cache
def ip_binary() -> str:
    found = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)
    if found is None:
        raise WanError("the rehearsal needs the `ip` command (iproute2); install it (apt-get install iproute2)")
    return found


def run_ip(*args: str, timeout: float = IP_TIMEOUT) -> str:
    argv = [ip_binary(), *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)  # noqa: S603 - argv list
    except subprocess.TimeoutExpired as e:
        raise WanError(f"`ip {' '.join(args)}` did not finish within {timeout:.0f} s") from e
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WanError(f"`ip {' '.join(args)}` failed (exit {done.returncode}): {tail[0]}")
    return done.stdout


def namespace_name(owner: int, seq: int, region: str) -> str:
    return f"{PREFIX}{owner}-{seq}-{region}"


def owner_of(name: str) -> int | None:
    m = _OWNED.match(name)
    return int(m.group(1)) if m else None


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def add_namespace(name: str) -> None:
    run_ip("netns", "add", name)
    # Loopback up: a server on 127.0.0.1 inside is private to the namespace, as on its own host.
    run_ip("-n", name, "link", "set", "lo", "up")


def delete_namespace(name: str, grace: float = 0.0) -> None:
    """Stop what still runs inside (SIGTERM, then SIGKILL after ``grace``), then remove the name.

    A namespace disappears when its name is removed and no process holds it; the TUN device inside
    goes with it, or earlier, when the forwarder closes its file descriptor.
    """
    if grace > 0:
        terminate([Inside(name)], grace)
    kill_inside(name, signal.SIGKILL)  # what is left, or started meanwhile
    try:
        run_ip("netns", "delete", name)
    except WanError:
        if (NETNS_DIR / name).exists():
            raise


def namespace_pids(name: str) -> list[int]:
    try:
        st = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return []
    key = (st.st_dev, st.st_ino)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ns = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (ns.st_dev, ns.st_ino) == key:
            pids.append(int(entry))
    return pids


@dataclass(frozen=True)
class Inside:
    """The processes in namespace ``name``, as ``geoshard.util.procs.terminate`` ends them: signalled
    together (through pidfds), running while any is left."""

    name: str

    def send_signal(self, sig: int) -> None:
        kill_inside(self.name, sig)

    def poll(self) -> int | None:
        return None if any(pid != os.getpid() for pid in namespace_pids(self.name)) else 0


def kill_inside(name: str, sig: int) -> int:
    """Signal every process in the namespace; returns how many were signalled."""
    try:
        st = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return 0
    n = 0
    for pid in namespace_pids(name):
        if pid == os.getpid():
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            ns = os.stat(f"/proc/{pid}/ns/net")  # still the same process (the pidfd pins it) and namespace
            if (ns.st_dev, ns.st_ino) == (st.st_dev, st.st_ino):
                signal.pidfd_send_signal(pidfd, sig)
                n += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return n


def clear_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces an earlier run left: ours by name, and their owner's pid is gone."""
    removed = []
    for name in list_namespaces(prefix):
        owner = owner_of(name)
        if owner is None or owner == os.getpid() or pid_alive(owner):
            continue
        log.warning("removing WAN namespace %s left by an earlier run (pid %d is gone)", name, owner)
        delete_namespace(name)
        removed.append(name)
    return removed


def open_tun() -> tuple[int, str]:
    """A fresh, non-persistent TUN device (no packet info header): it vanishes when its last fd closes."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise WanError(f"/dev/net/tun: {e.strerror}; the rehearsal needs the tun module and root") from e
    try:
        ifr = fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", b"gsw%d", _IFF_TUN | _IFF_NO_PI))
    except OSError as e:
        os.close(fd)
        raise WanError(f"/dev/net/tun: TUNSETIFF failed: {e.strerror}") from e
    return fd, ifr[:16].rstrip(b"\0").decode()


def configure_region(ns: str, tun: str, ifname: str, address: str, peers: list[str], mtu: int) -> None:
    """Move the TUN device into ``ns`` as ``ifname`` with ``address``/32 and a host route per peer.

    No default route: only the other regions' addresses are reachable, through the forwarder;
    nothing leaves toward the host or the outside.
    """
    run_ip("link", "set", tun, "netns", ns)
    run_ip("-n", ns, "link", "set", tun, "name", ifname)
    run_ip("-n", ns, "link", "set", ifname, "addrgenmode", "none")  # no IPv6 link-local chatter
    run_ip("-n", ns, "link", "set", ifname, "mtu", str(mtu), "up")
    run_ip("-n", ns, "addr", "add", f"{address}/32", "dev", ifname)
    for peer in peers:
        run_ip("-n", ns, "route", "add", f"{peer}/32", "dev", ifname, "src", address)


_SYSCTL_KEY = re.compile(r"^net\.(core|ipv4)\.[a-z0-9_]+$")
_SYSCTL_VALUE = re.compile(r"^[A-Za-z0-9_.-]+( [A-Za-z0-9_.-]+)*$")


def check_sysctl(key: str, value: str) -> None:
    """A network setting a namespace may take: ``net.core.*`` or ``net.ipv4.*``, a plain value."""
    if not _SYSCTL_KEY.match(key):
        raise WanError(f"sysctl {key!r}: only net.core.* and net.ipv4.* settings apply to a region's namespace")
    if not _SYSCTL_VALUE.match(value):
        raise WanError(f"sysctl {key}: value {value!r} is not a plain number or word")


def sysctl_path(key: str) -> Path:
    return Path("/proc/sys", *key.split("."))


def set_sysctl(ns: str, key: str, value: str) -> None:
    """Write ``key`` in namespace ``ns``: /proc/sys/net shows the namespace of the thread that opens it."""
    check_sysctl(key, value)
    with inside(ns):
        try:
            sysctl_path(key).write_text(value + "\n")
        except OSError as e:
            why = e.strerror or str(e)
            if key == "net.ipv4.tcp_congestion_control":  # the kernel lets a namespace default only to an allowed one
                allowed = sysctl_path("net.ipv4.tcp_allowed_congestion_control").read_text().strip()
                why += f" (a namespace's default must be one the host allows, net.ipv4.tcp_allowed_congestion_control: {allowed})"
            raise WanError(f"sysctl {key}={value} in {ns}: {why}") from e


def get_sysctl(ns: str, key: str) -> str:
    check_sysctl(key, "0")
    with inside(ns):
        try:
            return sysctl_path(key).read_text().strip()
        except OSError as e:
            raise WanError(f"sysctl {key} in {ns}: {e.strerror or e}") from e


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the block with this thread in namespace ``ns`` (sockets made there stay there).

    setns changes only the calling thread; the previous namespace is restored on the way out.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            target = os.open(NETNS_DIR / ns, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise WanError(f"network namespace {ns} does not exist") from None
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)
