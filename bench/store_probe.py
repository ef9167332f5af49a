"""Round trips of TCPStore operations across one WAN rehearsal link (the figures in docs/diloco.md,
"One outer round"): the store in us-east-1's namespace, a client in eu-west-1's, 50 ms one way
(a 100 ms round trip), 100 Mbit/s. Needs root.

    sudo .venv/bin/python bench/store_probe.py

``--rounds N``: the store transport's bulk reads instead, as an outer round makes them: the store
in us-east-1, a client in ap-southeast-1 (110 ms one way, 100 Mbit/s) that, once per round 3 s
apart, publishes a value of ``--mb`` MB and reads two others in one multi_get, on one kept
connection. ``--mtu`` and ``--sysctl KEY=VALUE`` as in bench/get_probe.py (on 12-07 this showed the
kernel's 131,072-byte receive buffer holding the first rounds back at the rehearsal's 65,000 MTU:
docs/wan.md).

    sudo .venv/bin/python bench/store_probe.py --rounds 5
    sudo .venv/bin/python bench/store_probe.py --rounds 5 --mtu 1500
    sudo .venv/bin/python bench/store_probe.py --rounds 5 --sysctl "net.ipv4.tcp_rmem=4096 131072 33554432"
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from geoshard.wan import Rehearsal, netns, parse_matrix

MATRIX = '[[link]]\na = "us-east-1"\nb = "eu-west-1"\nlatency_ms = 50\nbandwidth_mbit = 100\n'
FAR = '[[link]]\na = "us-east-1"\nb = "ap-southeast-1"\nlatency_ms = 110\nbandwidth_mbit = 100\n'


def timed(name: str, call: Callable[[], Any], repeat: int = 5) -> None:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{name}: {times[0] * 1000:.0f} ms min, {times[len(times) // 2] * 1000:.0f} ms median (round trip 100 ms)", flush=True)


def rounds(n: int, mb: float, mtu: int | None, sysctls: dict[str, str]) -> None:
    timeout = datetime.timedelta(seconds=60)
    size = int(mb * 1e6)
    kw: dict[str, Any] = {"sysctls": sysctls} | ({"mtu": mtu} if mtu else {})
    with Rehearsal(parse_matrix(FAR, "probe"), regions=("us-east-1", "ap-southeast-1"), **kw) as wan:
        far = wan.netns("ap-southeast-1")
        print(f"ap-southeast-1: tcp_rmem {netns.get_sysctl(far, 'net.ipv4.tcp_rmem')}, mtu {wan.mtu}", flush=True)
        with netns.inside(wan.netns("us-east-1")):
            server = dist.TCPStore(wan.address("us-east-1"), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        with netns.inside(far):
            client = dist.TCPStore(wan.address("us-east-1"), server.port, is_master=False, timeout=timeout)
        for i in range(1, n + 1):
            server.set(f"a{i}", b"a" * size)
            server.set(f"b{i}", b"b" * size)
        for i in range(1, n + 1):
            time.sleep(3)  # an outer round's idle between exchanges
            t0 = time.perf_counter()
            client.set(f"mine{i}", b"m" * size)
            t1 = time.perf_counter()
            client.multi_get([f"a{i}", f"b{i}"])
            t2 = time.perf_counter()
            print(f"round {i}: set {mb:g} MB {t1 - t0:.2f} s, multi_get 2 x {mb:g} MB {t2 - t1:.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=0, help="bulk reads over this many rounds instead of the round trips")
    ap.add_argument("--mb", type=float, default=2.6, help="each value's size in MB (2.6: a hidden-1024 model's fp16 pseudo-gradient)")
    ap.add_argument("--mtu", type=int)
    ap.add_argument("--sysctl", action="append", default=[], help="KEY=VALUE in every namespace")
    args = ap.parse_args()
    if args.rounds:
        rounds(args.rounds, args.mb, args.mtu, dict(kv.split("=", 1) for kv in args.sysctl))
        return
    timeout = datetime.timedelta(seconds=30)
    with Rehearsal(parse_matrix(MATRIX, "probe"), regions=("us-east-1", "eu-west-1")) as wan:
        with netns.inside(wan.netns("us-east-1")):
            server = dist.TCPStore(wan.address("us-east-1"), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        with netns.inside(wan.netns("eu-west-1")):
            client = dist.TCPStore(wan.address("us-east-1"), server.port, is_master=False, timeout=timeout)
        for key in "abc":
            server.set(key, "1")
        timed("check", lambda: client.check(["a"]))
        timed("get", lambda: client.get("a"))
        timed("set (small)", lambda: client.set("x", "1"))
        timed("multi_get of 3 keys", lambda: client.multi_get(["a", "b", "c"]))
        timed("wait on existing keys", lambda: client.wait(["a", "b"], datetime.timedelta(seconds=5)))
        timed("add", lambda: client.add("n", 1))
        small, large = b"x" * 200_000, b"x" * 5_000_000
        timed("set 200 KB", lambda: client.set("small", small))
        timed("get 200 KB", lambda: client.get("small"))
        timed("set 5 MB", lambda: client.set("large", large), 3)
        timed("get 5 MB", lambda: client.get("large"), 3)


if __name__ == "__main__":
    main()
