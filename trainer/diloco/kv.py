"""The outer store and values of any size in it.

A ``torch.distributed.TCPStore`` server (libuv) refuses a message over 8 MiB, and a pseudo-gradient
or the outer state of a real model is far larger: values go in parts of ``PART_BYTES``, under
``key/<i>``, then ``key`` itself = its head (number of parts, size, MAC of the bytes), signed and
last, so whoever sees ``key`` finds every part. Every value is signed with the job's secret
(``auth``) and a reader checks a head's size against its bound before it reads any part. Every
call is bounded: the store may be an ocean away, or gone.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any, Protocol

import torch.distributed as dist

from geoshard.errors import GeoshardError
from geoshard.trainer.diloco.auth import Refused, Signer

POLL_S = 0.02  # how often a leader looks at the store while it waits; one round trip each
PART_BYTES = 4 << 20
MAX_VALUE_BYTES = 1 << 40  # only for deleting a value this job signed


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
    """A store under one key prefix, with signed values of any size and bounded waits."""

    def __init__(self, store: Store, prefix: str, signer: Signer) -> None:
        self.store = store
        self.prefix = prefix
        self.signer = signer

    def key(self, *names: object) -> str:
        return "/".join([self.prefix, *map(str, names)])

    def get_many(self, keys: list[str]) -> list[bytes]:
        """Raw values of keys that exist: one round trip on a TCPStore (``multi_get``), else one each."""
        multi_get = getattr(self.store, "multi_get", None)
        return list(multi_get(keys)) if multi_get is not None else [self.store.get(k) for k in keys]

    def set(self, key: str, text: str) -> None:
        """A small value, signed."""
        self.store.set(key, self.signer.sign(key, text.encode()))

    def opened(self, key: str, raw: bytes) -> bytes | None:
        """The payload of a signed value; None (counted, and logged once per kind) when it is refused."""
        try:
            return self.signer.open(key, raw)
        except Refused as e:
            self.signer.refuse(key, e, raw)
            return None

    def get(self, key: str) -> bytes | None:
        """The payload under ``key``; None when it is not there or is refused."""
        return self.opened(key, self.store.get(key)) if self.store.check([key]) else None

    def open_many(self, keys: list[str]) -> list[bytes | None]:
        """Payloads of keys that exist, in one round trip; None for each refused."""
        return [self.opened(k, v) for k, v in zip(keys, self.get_many(keys), strict=True)]

    def put(self, key: str, payload: bytes) -> None:
        """A value of any size: its parts, then ``key`` = the number of parts, its size and its MAC, signed."""
        n = parts(len(payload))
        for i in range(n):
            self.store.set(f"{key}/{i}", payload[i * PART_BYTES : (i + 1) * PART_BYTES])
        self.set(key, f"{n} {len(payload)} {self.signer.mac(key, payload)}")

    def head(self, key: str, raw: bytes, max_bytes: int) -> tuple[int, str]:
        """A chunked value's size and MAC from its signed head; Refused when it is not signed or out of bounds."""
        fields = self.signer.open(key, raw).decode("ascii", errors="replace").split()
        if len(fields) != 3 or not fields[0].isdigit() or not fields[1].isdigit():
            raise Refused("malformed", "its head is not 'parts bytes mac'")
        n, nbytes = int(fields[0]), int(fields[1])
        if nbytes > max_bytes or n != parts(nbytes):
            raise Refused("malformed", f"{n} parts of {nbytes} bytes claimed, the model allows at most {max_bytes} bytes")
        return nbytes, fields[2]

    def fetch(self, keys: list[str], max_bytes: int) -> list[bytes | Refused]:
        """Values written by ``put``, each checked against ``max_bytes`` before its parts are read and
        against its MAC after: one ``multi_get`` of the heads, one of every part."""
        heads: dict[str, tuple[int, str] | Refused] = {}
        for key, raw in zip(keys, self.get_many(keys), strict=True):
            try:
                heads[key] = self.head(key, raw, max_bytes)
            except Refused as e:
                heads[key] = e
        wanted = [(k, i) for k, h in heads.items() if not isinstance(h, Refused) for i in range(parts(h[0]))]
        values = dict(zip(wanted, self.get_many([f"{k}/{i}" for k, i in wanted]), strict=True))
        out: list[bytes | Refused] = []
        for key in keys:
            h = heads[key]
            if isinstance(h, Refused):
                out.append(h)
                continue
            payload = b"".join(values[(key, i)] for i in range(parts(h[0])))
            try:
                if len(payload) != h[0]:
                    raise Refused("malformed", f"its parts hold {len(payload)} bytes, its head says {h[0]}")
                self.signer.check_mac(key, payload, h[1])
                out.append(payload)
            except Refused as e:
                out.append(e)
        return out

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
                with contextlib.suppress(Refused):  # not ours: its parts are not counted on
                    for i in range(parts(self.head(key, self.store.get(key), MAX_VALUE_BYTES)[0])):
                        delete(f"{key}/{i}")
                delete(key)
        for key in plain:
            delete(key)
