"""Gloo process groups of the peer-to-peer exchange, made directly on the outer store.

A group is a ``ProcessGroupGloo`` over ``PrefixStore(prefix, store)``: the store carries only its
rendezvous (each rank's address, a few hundred bytes), the tensors go between the ranks. Each
group's device binds only where the rank is told to (``Bind``: the region's address under the WAN
rehearsal, the interface of ``GLOO_SOCKET_IFNAME``, 127.0.0.1 on one machine; docs/guarantees.md
section 10). Groups are made once per membership, all at once (``GroupCache.make_all``: each its
own thread, so a new membership costs one rendezvous, not one per group), and reused while it
holds.

``CountingStore`` wraps the store client and counts the bytes every call carries, so a round's
traffic through the store is recorded (``store_bytes``).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

from geoshard.errors import ConfigError


@dataclass(frozen=True)
class Bind:
    """Where a rank's gloo sockets listen: an address of this machine, or an interface."""

    hostname: str = ""
    interface: str = ""

    def __post_init__(self) -> None:
        if bool(self.hostname) == bool(self.interface):
            raise ConfigError("the exchange's gloo sockets need exactly one of an address or an interface to bind")

    def device(self) -> Any:
        return ProcessGroupGloo.create_device(hostname=self.hostname, interface=self.interface)


LOOPBACK = Bind(hostname="127.0.0.1")


class CountingStore(dist.Store):
    """A store client that counts the bytes of keys and values it sends and receives."""

    def __init__(self, inner: Any, parent: CountingStore | None = None) -> None:
        super().__init__()
        self.inner = inner
        self._parent = parent  # a clone counts into the store it was cloned from
        self._lock = threading.Lock()
        self._bytes = 0

    @property
    def carried(self) -> int:
        """Bytes of keys and values sent and received so far (by its clones too)."""
        return self._bytes

    def _count(self, n: int) -> None:
        if self._parent is not None:
            self._parent._count(n)
            return
        with self._lock:
            self._bytes += n

    def clone(self) -> CountingStore:
        """A client of its own (a new connection to the same store), counted here: a store
        client serializes its calls, and a blocking wait holds it, so groups made at once each
        need one, or one group's wait blocks the key another rank's group waits for."""
        return CountingStore(self.inner.clone(), self._parent or self)

    def set(self, key: str, value: Any) -> None:
        self._count(len(key) + len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count(len(key) + len(value))
        return bytes(value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = [bytes(v) for v in self.inner.multi_get(keys)]
        self._count(sum(map(len, keys)) + sum(map(len, values)))
        return values

    def add(self, key: str, value: int) -> int:
        self._count(len(key) + 8)
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        self._count(sum(map(len, keys)))
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._count(sum(map(len, keys)))
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count(len(key) + len(expected) + len(desired))
        return bytes(self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        self._count(len(key))
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def gloo_group(store: Any, prefix: str, rank: int, size: int, bind: Bind, timeout_s: float) -> Any:
    """A gloo group of ``size`` ranks meeting under ``prefix``; blocks until all of them made it
    (at most ``timeout_s``: gloo's connect and every later collective have that bound)."""
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [bind.device()]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, opts)


class GroupCache:
    """Groups by key, made on first use; ``keep`` drops the ones a new membership no longer uses."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, Any] = {}

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key not in self._groups:
            self._groups[key] = make()
        return self._groups[key]

    def make_all(self, wanted: Sequence[tuple[Hashable, Callable[[], Any]]]) -> None:
        """Make the missing ones of ``wanted`` all at once, one thread each: a group's rendezvous
        waits on the store and on its peers (a few round trips across the WAN), so made one after
        another they took about 2.5 s each under the rehearsal. Each wait has the group's own
        timeout; the first that fails raises once the others are done."""
        missing = [(key, make) for key, make in wanted if key not in self._groups]  # ``make``s use their own store clients
        if len(missing) <= 1:
            for key, make in missing:
                self._groups[key] = make()
            return
        with ThreadPoolExecutor(len(missing), thread_name_prefix="gloo-group") as pool:
            futures = [(key, pool.submit(make)) for key, make in missing]
        for key, future in futures:
            self._groups[key] = future.result()

    def keep(self, wanted: Callable[[Hashable], bool]) -> None:
        for key in [k for k in self._groups if not wanted(k)]:
            del self._groups[key]

    def __len__(self) -> int:
        return len(self._groups)
