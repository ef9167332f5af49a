"""DiLoCo across regions: each region trains alone for H inner steps, then the regions average
their pseudo-gradients (outer parameters minus current parameters) and apply them with an outer
Nesterov SGD step (arXiv 2311.08105; lr 0.7, momentum 0.9 by default).

Why not torchft, and why a store (docs/diloco.md has the longer story): a region is several ranks
doing DDP in their own process group, and a region that is lost must not break the others'
groups, so the regions never share a process group. Their leaders meet in a key-value store
that tolerates missing members: a ``torch.distributed.TCPStore`` hosted by the launcher (which
outlives every region), or anything with the same ``set``/``get``/``add``/``check`` methods.

One outer round ``r``, on each region's leader (in-region rank 0):
  1. publish the compressed pseudo-gradient under ``r`` and the region;
  2. wait, at most ``round_timeout_s``, for the regions expected in ``r`` (the members of round
     ``r-1`` and any region that announced a rejoin);
  3. the first leader done waiting closes the round: it writes the regions whose pseudo-gradient
     is there (an atomic ``add`` picks one closer, so every leader averages over the same set);
  4. each leader averages over those regions in job order (the same sum everywhere), applies the
     outer step, and the closer publishes the new outer state (parameters, momentum) for the
     round, so a region that rejoins starts from it (live recovery);
  5. the leader broadcasts the new parameters in its region.
A region whose pseudo-gradient missed the close (it was late or is rejoining) takes the round's
published state instead of its own result and goes on from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from geoshard.errors import ConfigError, GeoshardError

log = logging.getLogger(__name__)

COMPRESSIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": torch.float32}
POLL_S = 0.02  # how often a leader looks at the store while it waits; one round trip each
# Values go into the store in parts of this size: a TCPStore server (libuv) refuses a message over
# 8 MiB, and a pseudo-gradient or the outer state of a real model is far larger.
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


@dataclass(frozen=True)
class OuterSync:
    outer_steps: int = 100  # H: inner steps between outer rounds
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: str = "fp16"  # of the pseudo-gradient on the long links: fp16 | bf16 | none
    round_timeout_s: float = 60.0  # how long a leader waits for the expected regions
    join_timeout_s: float = 300.0  # how long a starting region waits for the first published state
    # Inner steps a round's exchange runs behind (0: the region waits for each round). With k > 0
    # the round starts at step nH, training goes on, and at step nH + k the region takes the new
    # outer parameters plus what it learnt in those k steps (Streaming DiLoCo's overlap, arXiv 2501.18512).
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if self.outer_steps < 1:
            raise ConfigError(f"outer_steps must be 1 or more, got {self.outer_steps}")
        if self.outer_lr <= 0:
            raise ConfigError(f"outer_lr must be above 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"outer compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.round_timeout_s <= 0 or self.join_timeout_s <= 0:
            raise ConfigError("round_timeout_s and join_timeout_s must be above 0")
        if not 0 <= self.overlap_steps < self.outer_steps:
            raise ConfigError(f"overlap_steps must be at least 0 and below outer_steps ({self.outer_steps}), got {self.overlap_steps}")


@dataclass(frozen=True)
class RoundRecord:
    round: int
    step: int  # the region's inner step count at the round
    regions: tuple[str, ...]  # whose pseudo-gradients were averaged
    missing: tuple[str, ...]  # regions of the job that were not (those that finished their steps are not missing)
    sync_s: float  # from publishing to the new parameters in place, on this region
    bytes_published: int  # by this region's leader: pseudo-gradient, and the state when it closed the round
    bytes_read: int  # by this region's leader: the other regions' pseudo-gradients (or the state it adopted)
    compression: str
    adopted: bool = False  # this region missed the close and took the round's published state
    exchange_s: float = 0.0  # the exchange itself (with overlap it runs behind training; sync_s is what training waited)
    applied_step: int = 0  # the inner step at which the region took the round's result (step + overlap)


@dataclass(frozen=True)
class JoinRecord:
    round: int  # the round whose state the region starts from
    step: int  # the inner step count of the region that published it
    created: bool  # this region published round 0 (a fresh job)
    bytes_read: int


def _parts(nbytes: int) -> int:
    return max(1, -(-nbytes // PART_BYTES))


@dataclass
class _Pending:
    """A round whose exchange runs behind training (``overlap_steps`` > 0)."""

    step: int
    apply_at: int
    snapshot: torch.Tensor | None = None  # the leader's parameters when the round started
    thread: threading.Thread | None = None
    record: RoundRecord | None = None
    error: BaseException | None = None
    blocked_s: float = 0.0


def host_store(host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """The launcher's store (it outlives every region); ``.port`` is the port it got."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """A region leader's connection; every call on it is bounded by ``timeout_s``."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OuterSyncError(f"DiLoCo: cannot reach the outer store at {host}:{port} within {timeout_s:g} s ({first})") from e


def encode(delta: torch.Tensor, compression: str) -> bytes:
    """A flat fp32 tensor → the bytes published (cast to the compression's dtype)."""
    t = delta.detach().to(COMPRESSIONS[compression]).contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes()


def decode(payload: bytes, compression: str) -> torch.Tensor:
    """The published bytes → a flat fp32 tensor on the CPU."""
    dtype = COMPRESSIONS[compression]
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).to(torch.float32)


class DiLoCo:
    """One per rank. The region leader (in-region rank 0) keeps the outer parameters and the outer
    optimizer and talks to the store; the other ranks of the region receive the new parameters by
    broadcast in ``group`` (the region's own process group; ``None`` for a one-rank region).

    ``join(store)`` first (collective in the region), then ``maybe_sync(step)`` after every inner
    optimizer step: every ``outer_steps`` steps it runs a round and returns its ``RoundRecord``.
    """

    def __init__(
        self, model: nn.Module, sync: OuterSync, region: str, regions: Sequence[str], group: Any = None, prefix: str = "diloco"
    ) -> None:
        bad = [g for g in regions if not g or "," in g or "/" in g]
        if bad or len(set(regions)) != len(regions):
            raise ConfigError(f"DiLoCo: the job's regions must be distinct names without ',' or '/', got {', '.join(regions)}")
        if region not in regions:
            raise ConfigError(f"region {region!r} is not one of the job's regions ({', '.join(regions)})")
        self.model = model
        self.sync = sync
        self.region = region
        self.regions = tuple(regions)
        self.group = group
        self.prefix = prefix
        self.params = [p for p in model.parameters()]
        self.is_leader = group is None or dist.get_rank(group) == 0
        self.round = 0  # the next round this region takes part in
        self.store: Store | None = None
        self._outer: torch.Tensor | None = None
        self._opt: torch.optim.SGD | None = None
        self._pending: _Pending | None = None  # the round in flight (overlap_steps > 0)
        self._step = 0  # the last inner step maybe_sync saw

    # -- keys -------------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _grad_key(self, r: int, region: str) -> str:
        return self._key("r", r, "grad", region)

    # -- flat views -------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _load_flat(self, flat: torch.Tensor) -> None:
        i = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[i : i + n].view_as(p))
                i += n

    def _set_outer(self, flat: torch.Tensor, momentum: torch.Tensor | None) -> None:
        s = self.sync
        self._outer = flat.detach().clone()
        self._opt = torch.optim.SGD([self._outer], lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov and s.outer_momentum > 0)
        if momentum is not None:
            self._opt.state[self._outer]["momentum_buffer"] = momentum.clone()

    @property
    def outer(self) -> torch.Tensor:
        """The outer parameters (flat fp32), on the leader."""
        if self._outer is None:
            raise OuterSyncError("DiLoCo: call join(store) before the first round")
        return self._outer

    def _state_bytes(self, r: int, step: int) -> bytes:
        assert self._opt is not None
        mom = self._opt.state.get(self.outer, {}).get("momentum_buffer")
        buf = io.BytesIO()
        torch.save({"round": r, "step": step, "params": self.outer, "momentum": mom}, buf)
        return buf.getvalue()

    # -- the store, bounded -------------------------------------------------------------------
    def _wait_key(self, key: str, timeout_s: float, what: str) -> None:
        assert self.store is not None
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise OuterSyncError(f"DiLoCo: {what} did not appear in the store within {timeout_s:g} s (key {key})")
            time.sleep(POLL_S)

    def _load_state(self, r: int) -> tuple[int, int, int]:
        """Adopt the state published for round ``r``: (round, step, bytes read)."""
        assert self.store is not None
        if not self.store.check([self._key("state", r)]):
            raise KeyError(r)
        (payload,) = self._fetch([self._key("state", r)])
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location=self.params[0].device)
        self._set_outer(state["params"], state["momentum"])
        return int(state["round"]), int(state["step"]), len(payload)

    def _adopt_latest(self, at_least: int) -> tuple[int, int, int]:
        """Load the newest published state once it is round ``at_least`` or later: (its round, its step, bytes read)."""
        deadline = time.monotonic() + self.sync.round_timeout_s
        while True:
            latest = self._latest()
            if latest is not None and latest >= at_least:
                with contextlib.suppress(KeyError):  # a newer round's closer may have just dropped it
                    return self._load_state(latest)
            if time.monotonic() > deadline:
                raise OuterSyncError(f"DiLoCo: no outer state of round {at_least} or later within {self.sync.round_timeout_s:g} s")
            time.sleep(POLL_S)

    def _latest(self) -> int | None:
        assert self.store is not None
        if not self.store.check([self._key("latest")]):
            return None
        return int(self.store.get(self._key("latest")))

    def _publish_state(self, r: int, step: int) -> int:
        assert self.store is not None
        payload = self._state_bytes(r, step)
        self._put(self._key("state", r), payload)
        self.store.set(self._key("latest"), str(r))
        return len(payload)

    # -- region collectives -----------------------------------------------------------------
    def _in_region(self, obj: Any, params: torch.Tensor | None = None) -> Any:
        """Leader's new parameters (``params``, else the outer ones) and ``obj`` → every rank of the region."""
        if self.group is None:
            return obj
        flat = (self.outer if params is None else params).clone() if self.is_leader else self._flat()
        dist.broadcast(flat, group=self.group, group_src=0)
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        if not self.is_leader:
            self._load_flat(flat)
        return box[0]

    # -- join -------------------------------------------------------------------------------
    def _contract(self) -> dict[str, Any]:
        """What every region of the job must agree on (timeouts may differ)."""
        s = self.sync
        return {
            "regions": list(self.regions),
            "parameters": sum(p.numel() for p in self.params),
            "outer_steps": s.outer_steps,
            "outer_lr": s.outer_lr,
            "outer_momentum": s.outer_momentum,
            "nesterov": s.nesterov,
            "compression": s.compression,
        }

    def _check_contract(self) -> None:
        assert self.store is not None
        key = self._key("config")
        if not self.store.check([key]):
            return
        theirs = json.loads(self.store.get(key))
        ours = self._contract()
        diff = [f"{k} {ours[k]} (the job has {theirs.get(k)})" for k in ours if theirs.get(k) != ours[k]]
        if diff:
            raise ConfigError(f"DiLoCo: region {self.region} does not match the job's outer settings: {'; '.join(diff)}")

    def join(self, store: Store | None) -> JoinRecord:
        """Start from the newest published outer state (a region restarting: live recovery), or, in a
        fresh job, the first region publishes its own parameters as round 0 and the others take them."""
        rec: JoinRecord | None = None
        if self.is_leader:
            if store is None:
                raise ConfigError("DiLoCo.join: the region leader needs the outer store")
            self.store = store
            latest = self._latest()
            created = False
            if latest is None and self.region == self.regions[0] and store.add(self._key("created"), 1) == 1:
                self._set_outer(self._flat(), None)
                store.set(self._key("config"), json.dumps(self._contract()))
                for g in self.regions:  # every region is expected from round 1 (until it is waited for in vain)
                    store.set(self._roster_key(g), "1")
                store.set(self._key("r", 0, "members"), ",".join(self.regions))
                self._publish_state(0, 0)
                latest, created = 0, True
            if latest is None:
                self._wait_key(self._key("latest"), self.sync.join_timeout_s, "the job's first outer state")
                latest = self._latest()
                assert latest is not None
            if created:
                r, step, nbytes = 0, 0, 0
            else:
                self._check_contract()
                r, step, nbytes = self._adopt_latest(latest)
            self._load_flat(self.outer)
            self.round = r + 1
            # The others wait for this region from the round after the one it starts from.
            store.set(self._roster_key(self.region), str(self.round))
            rec = JoinRecord(r, step, created, nbytes)
            log.info("DiLoCo: region %s starts from outer round %d (step %d)", self.region, r, step)
        rec = self._in_region(rec)
        assert rec is not None
        self.round = rec.round + 1
        return rec

    # -- the outer round ------------------------------------------------------------------------
    def maybe_sync(self, step: int) -> RoundRecord | None:
        """After inner step ``step`` (1-based): a round when ``step`` is a multiple of ``outer_steps``;
        with ``overlap_steps`` k, the round starts there and its record comes k steps later."""
        k = self.sync.overlap_steps
        self._step = step
        if k == 0:
            return None if step % self.sync.outer_steps else self.sync_now(step)
        rec = self.finish() if self._pending is not None and step >= self._pending.apply_at else None
        if step % self.sync.outer_steps == 0:
            self._start(step)
        return rec

    def sync_now(self, step: int) -> RoundRecord:
        """Collective in the region: one outer round."""
        t0 = time.perf_counter()
        rec: RoundRecord | None = None
        if self.is_leader:
            rec = self._exchange(step, encode(self.outer - self._flat(), self.sync.compression), t0)
            self._load_flat(self.outer)
            rec = dataclasses.replace(rec, exchange_s=rec.sync_s, applied_step=step)
        rec = self._in_region(rec)
        assert rec is not None
        self.round = rec.round + 1
        if not self.is_leader:
            rec = dataclasses.replace(rec, sync_s=time.perf_counter() - t0)
        return rec

    def _start(self, step: int) -> None:
        """The leader starts the round's exchange in a thread; training goes on meanwhile."""
        t0 = time.perf_counter()
        pending = _Pending(step, step + self.sync.overlap_steps)
        if self.is_leader:
            pending.snapshot = self._flat()
            payload = encode(self.outer - pending.snapshot, self.sync.compression)

            def run() -> None:
                try:
                    pending.record = self._exchange(step, payload, time.perf_counter())
                except BaseException as e:  # handed to the training thread in finish()
                    pending.error = e

            # Only this thread uses the store and the outer tensors until finish(); the training
            # thread touches the model's parameters only.
            pending.thread = threading.Thread(target=run, name=f"diloco-round-{self.round}", daemon=True)
            pending.thread.start()
        pending.blocked_s = time.perf_counter() - t0
        self._pending = pending

    def finish(self) -> RoundRecord | None:
        """Collective in the region: take the round in flight, if any (the trainer calls it after the
        last step too). New parameters: the round's outer ones plus the steps since it started."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        t0 = time.perf_counter()
        rec: RoundRecord | None = None
        params = None
        if self.is_leader:
            assert pending.thread is not None and pending.snapshot is not None
            pending.thread.join()
            if pending.error is not None:
                raise pending.error
            assert pending.record is not None
            params = self.outer + (self._flat() - pending.snapshot)
            self._load_flat(params)
            rec = dataclasses.replace(pending.record, exchange_s=pending.record.sync_s)
        rec = self._in_region(rec, params)
        assert rec is not None
        self.round = rec.round + 1
        waited = pending.blocked_s + time.perf_counter() - t0
        return dataclasses.replace(rec, sync_s=waited, applied_step=self._step)

    def _roster_key(self, region: str) -> str:
        return self._key("roster", region)

    def _roster(self) -> tuple[dict[str, str], int]:
        """Every region's roster entry and the newest published round, in one round trip: ``R``
        (expected from round R on), ``-1`` (waited for in vain; expected again once it announces
        itself), ``left`` (finished its steps)."""
        keys = [self._roster_key(g) for g in self.regions] + [self._key("latest")]
        values = [v.decode() for v in self._get_many(keys)]
        return dict(zip(self.regions, values[:-1], strict=True)), int(values[-1])

    def _get_many(self, keys: list[str]) -> list[bytes]:
        """Values of keys that exist: one round trip on a TCPStore (``multi_get``), else one each."""
        assert self.store is not None
        multi_get = getattr(self.store, "multi_get", None)
        return list(multi_get(keys)) if multi_get is not None else [self.store.get(k) for k in keys]

    def _put(self, key: str, payload: bytes) -> None:
        """A value of any size: its parts under ``key/<i>``, then ``key`` itself = the number of
        parts, last, so whoever sees ``key`` finds every part."""
        assert self.store is not None
        n = _parts(len(payload))
        for i in range(n):
            self.store.set(f"{key}/{i}", payload[i * PART_BYTES : (i + 1) * PART_BYTES])
        self.store.set(key, str(n))

    def _fetch(self, keys: list[str], parts: int | None = None) -> list[bytes]:
        """Values written by ``_put``, in one ``multi_get`` of all their parts (plus one for the
        numbers of parts, unless ``parts`` gives it)."""
        counts = [parts] * len(keys) if parts is not None else [int(v) for v in self._get_many(keys)]
        values = self._get_many([f"{k}/{i}" for k, n in zip(keys, counts, strict=True) for i in range(n)])
        out, j = [], 0
        for n in counts:
            out.append(b"".join(values[j : j + n]))
            j += n
        return out

    def _wait_all(self, keys: list[str], timeout_s: float) -> bool:
        """Until every key exists (True) or ``timeout_s`` passed (False). A TCPStore waits on its
        server (one round trip once the last key is there); other stores are polled."""
        assert self.store is not None
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

    def left(self) -> set[str]:
        """Regions that finished their steps (``leave``): no longer waited for, nor counted missing."""
        roster, _ = self._roster()
        return {g for g, v in roster.items() if v == "left"}

    def leave(self) -> None:
        """The region finished its steps: the others stop waiting for it from their next round on."""
        if self.is_leader and self.store is not None:
            self.store.set(self._roster_key(self.region), "left")

    def _members(self, r: int) -> tuple[str, ...] | None:
        assert self.store is not None
        key = self._key("r", r, "members")
        return tuple(self.store.get(key).decode().split(",")) if self.store.check([key]) else None

    def _exchange(self, step: int, payload: bytes, t0: float) -> RoundRecord:
        """One round on the leader, in about six round trips to the store (it may be an ocean away)
        plus the pseudo-gradients' bytes. Updates the outer state only, never the model."""
        store, s, r = self.store, self.sync, self.round
        if store is None:
            raise OuterSyncError("DiLoCo: call join(store) before the first round")
        published = len(payload)
        self._put(self._grad_key(r, self.region), payload)
        roster, latest = self._roster()
        gone = {g for g, v in roster.items() if v == "left"}
        members: tuple[str, ...] | None = None
        closer = False
        if latest < r:  # else this region is rounds behind: the round closed and may be forgotten
            expected = [g for g, v in roster.items() if v.lstrip("-").isdigit() and 0 <= int(v) <= r]
            self._wait_all([self._grad_key(r, g) for g in expected], s.round_timeout_s)
            members_key = self._key("r", r, "members")
            if store.add(self._key("r", r, "close"), 1) == 1:
                # The closer: the regions whose pseudo-gradient is there now are the round's members.
                members = tuple(g for g in self.regions if g in expected and store.check([self._grad_key(r, g)]))
                for g in expected:
                    if g not in members:  # lost, or too slow: not waited for again until it announces itself
                        store.set(self._roster_key(g), "-1")
                store.set(members_key, ",".join(members))  # last: a late region re-announces only after this
                closer = True
            elif self._wait_all([members_key], s.round_timeout_s):
                members = tuple(store.get(members_key).decode().split(","))
        missing = tuple(g for g in self.regions if (members is None or g not in members) and g not in gone)
        if members is None or self.region not in members:
            # Too late for this round: take the newest published result, and go on from there.
            adopted, _, nbytes = self._adopt_latest(r)
            store.set(self._roster_key(self.region), str(adopted + 1))
            log.warning("DiLoCo: region %s missed outer round %d; it continues from round %d's published state", self.region, r, adopted)
            took = self._members(adopted)  # the record describes the round whose result this region now holds
            missing = tuple(g for g in self.regions if took is not None and g not in took and g not in gone)
            return RoundRecord(adopted, step, took or (), missing, time.perf_counter() - t0, published, nbytes, s.compression, adopted=True)
        others = [g for g in members if g != self.region]
        parts = _parts(len(payload))  # every region's pseudo-gradient has this size (checked at join)
        received = dict(zip(others, self._fetch([self._grad_key(r, g) for g in others], parts), strict=True))
        total = torch.zeros_like(self.outer)
        read = 0
        for g in members:  # job order: every leader sums the same values in the same order
            if g == self.region:
                total += decode(payload, s.compression).to(total.device)
                continue
            other = received[g]
            read += len(other)
            if len(other) != len(payload):  # the contract check at join makes this a store gone wrong
                raise OuterSyncError(f"DiLoCo: region {g}'s pseudo-gradient for round {r} has {len(other)} bytes, expected {len(payload)}")
            total += decode(other, s.compression).to(total.device)
        assert self._opt is not None
        self.outer.grad = total / len(members)
        self._opt.step()
        self.outer.grad = None
        # Every member holds the same outer state; the job's first region publishes it (the launcher
        # hosts the store beside it, so the fp32 state crosses no ocean), else the closer.
        first = self.regions[0]
        if (self.region == first) if first in members else closer:
            published += self._publish_state(r, step)
            self._forget(r - 2)
        if missing:
            log.warning("DiLoCo: outer round %d averaged over %s; missing %s", r, ", ".join(members), ", ".join(missing))
        return RoundRecord(r, step, members, missing, time.perf_counter() - t0, published, read, s.compression)

    def _forget(self, r: int) -> None:
        """Drop an old round's keys, where the store can (the newest state stays for rejoins)."""
        delete = getattr(self.store, "delete_key", None)
        if r < 1 or delete is None:
            return
        assert self.store is not None
        big = [self._key("state", r), *(self._grad_key(r, g) for g in self.regions)]
        for key in big:
            if self.store.check([key]):
                for i in range(int(self.store.get(key))):
                    delete(f"{key}/{i}")
                delete(key)
        for key in [self._key("r", r, "members"), self._key("r", r, "close")]:
            delete(key)
