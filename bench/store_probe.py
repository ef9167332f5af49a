"""Round trips of TCPStore operations across one WAN rehearsal link (the figures in docs/diloco.md,
"One outer round"): the store in us-east-1's namespace, a client in eu-west-1's, 50 ms one way
(a 100 ms round trip), 100 Mbit/s. Needs root.

    sudo .venv/bin/python bench/store_probe.py
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from geoshard.wan import Rehearsal, netns, parse_matrix

MATRIX = '[[link]]\na = "us-east-1"\nb = "eu-west-1"\nlatency_ms = 50\nbandwidth_mbit = 100\n'


def timed(name: str, call: Callable[[], Any], repeat: int = 5) -> None:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{name}: {times[0] * 1000:.0f} ms min, {times[len(times) // 2] * 1000:.0f} ms median (round trip 100 ms)", flush=True)


def main() -> None:
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
