"""The outer store and values of any size in it.

A ``torch.distributed.TCPStore`` server (libuv) refuses a message over 8 MiB, and a pseudo-gradient
or the outer state of a real model is far larger: values go in parts of ``PART_BYTES``, under
``key/<i>``, then ``key`` itself = the number of parts, last, so whoever sees ``key`` finds every
part. Every call is bounded: the store may be an ocean away, or gone.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Protocol

import torch.distributed as dist

from geoshard.errors import GeoshardError

POLL_S = 0.02  # how often a leader looks at the store while it waits; one round trip each
PART_BYTES = 4 << 20


class OuterSyncError(GeoshardError):
    """The outer exchange could not go on (the store is gone, or no state to rejoin from in time)."""

    exit_code = 1


class Store(Protocol):
    """What the outer exchange needs from a store; ``torch.distributed.TCPStore`` has it."""

    def set(self, key: str, value: Any) -> None: ...  # bytes or str (TCPStore's stub says str; it takes both)
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


def host_store(host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """The launcher's store (it outlives every region); ``.port`` is the port it got."""
    from geoshard.trainer.listen import master_store

    return master_store(host, port, timeout_s=timeout_s)  # on host only, not every address


def connect_store(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """A region leader's connection; every call on it is bounded by ``timeout_s``."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OuterSyncError(f"DiLoCo: cannot reach the outer store at {host}:{port} within {timeout_s:g} s ({first})") from e


def parts(nbytes: int) -> int:
    """How many parts a value of ``nbytes`` takes."""
    return max(1, -(-nbytes // PART_BYTES))


class KV:
    """A store under one key prefix, with values of any size and bounded waits."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def key(self, *names: object) -> str:
        return "/".join([self.prefix, *map(str, names)])

    def get_many(self, keys: list[str]) -> list[bytes]:
        """Values of keys that exist: one round trip on a TCPStore (``multi_get``), else one each."""
        multi_get = getattr(self.store, "multi_get", None)
        return list(multi_get(keys)) if multi_get is not None else [self.store.get(k) for k in keys]

    def get_if(self, key: str) -> bytes | None:
        """The value of ``key``, None when it is not there."""
        return self.store.get(key) if self.store.check([key]) else None

    def put(self, key: str, payload: bytes) -> None:
        """A value of any size: its parts, then ``key`` = the number of parts."""
        n = parts(len(payload))
        for i in range(n):
            self.store.set(f"{key}/{i}", payload[i * PART_BYTES : (i + 1) * PART_BYTES])
        self.store.set(key, str(n))

    def fetch(self, keys: list[str], nparts: int | None = None) -> list[bytes]:
        """Values written by ``put``, in one ``multi_get`` of all their parts (plus one for the
        numbers of parts, unless ``nparts`` gives it)."""
        counts = [nparts] * len(keys) if nparts is not None else [int(v) for v in self.get_many(keys)]
        values = self.get_many([f"{k}/{i}" for k, n in zip(keys, counts, strict=True) for i in range(n)])
        out, j = [], 0
        for n in counts:
            out.append(b"".join(values[j : j + n]))
            j += n
        return out

    def wait_key(self, key: str, timeout_s: float, what: str) -> None:
        """Until ``key`` exists; OuterSyncError naming ``what`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise OuterSyncError(f"DiLoCo: {what} did not appear in the store within {timeout_s:g} s (key {key})")
            time.sleep(POLL_S)

    def wait_all(self, keys: list[str], timeout_s: float) -> bool:
        """Until every key exists (True) or ``timeout_s`` passed (False). A TCPStore waits on its
        server (one round trip once the last key is there); other stores are polled."""
        wait = getattr(self.store, "wait", None)
        if wait is not None:
            try:
                wait(keys, datetime.timedelta(seconds=max(0.001, timeout_s)))
                return True
            except RuntimeError:  # DistStoreError: the timeout (or the store gone: the next call says so)
                return self.store.check(keys)
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def delete(self, plain: list[str], chunked: list[str]) -> None:
        """Drop keys where the store can (``delete_key``); a chunked value with all its parts."""
        delete = getattr(self.store, "delete_key", None)
        if delete is None:
            return
        for key in chunked:
            if self.store.check([key]):
                for i in range(int(self.store.get(key))):
                    delete(f"{key}/{i}")
                delete(key)
        for key in plain:
            delete(key)
