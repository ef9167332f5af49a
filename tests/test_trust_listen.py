"""Issue 20, part 1: every listener of ``geoshard train`` binds where it is asked, nowhere else.

The command runs as a user runs it (a subprocess); while it runs, the listening TCP sockets of
every process of the job (launcher, torchrun agents, ranks, loader workers) are read from /proc,
in each process's own network namespace: none may be on 0.0.0.0 or ::."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
from test_diloco_train import EU, GEOSHARD, US, local_plan

from geoshard.trainer.listen import master_store

FLAGS = ("--batch-size", "16", "--num-workers", "1", "--backend", "gloo", "--step-time", "0.1", "--hidden", "64")
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    return out


def job_pids(root: int) -> set[int]:
    """``root`` and every process below it."""
    seen, todo = set[int](), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += _children(pid)
    return seen


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = struct.unpack("<4I", raw)  # four host-order 32-bit words
    return str(ipaddress.IPv6Address(struct.pack(">4I", *words)))


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def _listen_table(pid: int) -> dict[str, tuple[str, int]]:
    """Listening sockets by inode in ``pid``'s network namespace."""
    found = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == LISTEN:
                    addr, port = cols[1].rsplit(":", 1)
                    found[cols[9]] = (_address(addr), int(port, 16))
    return found


def listeners(pids: set[int]) -> dict[int, set[tuple[str, int]]]:
    """The (address, port) of every listening TCP socket each of ``pids`` holds. The tables of all
    their namespaces are read: the launcher makes the rehearsal's stores inside the regions'."""
    table: dict[str, tuple[str, int]] = {}
    for pid in pids:
        table.update(_listen_table(pid))
    return {pid: {table[i] for i in _socket_inodes(pid) if i in table} for pid in pids}


def watch(argv: list[str], log: Path, timeout: float = 400.0) -> tuple[int, dict[tuple[str, int], str]]:
    """Run ``argv``; every listener any of its processes held while it ran, with who held it."""
    seen: dict[tuple[str, int], str] = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                for pid, socks in listeners(job_pids(proc.pid)).items():
                    for sock in socks:
                        with contextlib.suppress(OSError):
                            seen.setdefault(sock, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:160].decode())
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
    return code, seen


def wildcard(seen: dict[tuple[str, int], str]) -> list[str]:
    return [f"{a}:{p} ({who})" for (a, p), who in seen.items() if ipaddress.ip_address(a).is_unspecified]


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return local_plan(tmp_path_factory.mktemp("listen"), {US: 1, EU: 1}, samples=1200)


def test_a_store_listens_only_on_its_host() -> None:
    store = master_store("127.0.0.1", timeout_s=10)
    mine = listeners({os.getpid()})[os.getpid()]
    assert ("127.0.0.1", store.port) in mine and not wildcard({s: "" for s in mine})
    with socket.socket() as s:
        s.connect(("127.0.0.1", store.port))  # and it serves there
    for address in external_addresses():  # from outside the machine: refused
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect((address, store.port))


def external_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (from the kernel's routing table)."""
    found = set()
    with contextlib.suppress(OSError):
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        for prev, line in itertools.pairwise(lines):
            if "/32 host LOCAL" in line and (a := prev.split()[-1]) and not a.startswith("127."):
                found.add(a)
    return sorted(found)


@pytest.mark.slow
@pytest.mark.parametrize(
    "job",
    [
        ("--region", EU, "--nproc", "2"),
        ("--regions", f"{US}:1,{EU}:1"),
        ("--regions", f"{US}:1,{EU}:1", "--sync", "diloco", "--outer-steps", "5", "--outer-transport", "store"),
        ("--regions", f"{US}:1,{EU}:2", "--sync", "diloco", "--outer-steps", "5", "--outer-transport", "p2p"),
    ],
    ids=["one-region", "regions", "diloco", "diloco-p2p"],
)
def test_every_listener_of_the_job_is_on_loopback(plan: Path, tmp_path: Path, job: tuple[str, ...]) -> None:
    out = tmp_path / "run"
    argv = [GEOSHARD, "train", "--plan", str(plan), *job, *FLAGS, "--steps", "20", "--out", str(out)]
    code, seen = watch(argv, tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert not wildcard(seen), wildcard(seen)
    assert {a for a, _ in seen} == {"127.0.0.1"}, seen
    stores = [who for who in seen.values() if "torch.distributed.run" not in who and "geoshard.trainer" not in who]
    ranks = [who for who in seen.values() if "geoshard.trainer" in who and "torch.distributed.run" not in who]
    assert stores and ranks, seen  # the launcher's stores, and the ranks' (rank 0's group store, gloo) were seen


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN rehearsal needs root (CAP_NET_ADMIN)")
@pytest.mark.parametrize("sync", ["hierarchical", "diloco", "diloco-p2p"])
def test_under_wan_every_listener_is_on_its_regions_address(plan: Path, tmp_path: Path, sync: str) -> None:
    matrix = tmp_path / "wan.toml"
    matrix.write_text(f'[[link]]\na = "{US}"\nb = "{EU}"\nlatency_ms = 5\nbandwidth_mbit = 200\n')
    out = tmp_path / "run"
    argv = [GEOSHARD, "train", "--plan", str(plan), "--regions", f"{US}:1,{EU}:1", "--sync", sync.split("-")[0], *FLAGS, "--steps", "15"]
    argv += ["--outer-steps", "5"] if sync.startswith("diloco") else []
    if sync.startswith("diloco"):  # p2p: the exchange's gloo sockets too
        argv += ["--outer-transport", "p2p" if sync == "diloco-p2p" else "store"]
    code, seen = watch([*argv, "--out", str(out), "--wan", str(matrix)], tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert not wildcard(seen), wildcard(seen)
    addresses = {a for a, _ in seen}
    # The rehearsal's namespaces have their addresses in 198.18.0.0/24 (geoshard/wan/rehearsal.py).
    assert addresses and all(ipaddress.ip_address(a) in ipaddress.ip_network("198.18.0.0/24") for a in addresses), seen
