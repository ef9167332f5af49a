"""One outer round on a region leader, and the thread that runs it behind training.

The leader publishes its compressed pseudo-gradient, waits (at most ``round_timeout_s``) for the
regions the roster expects (not a region that finished meanwhile), closes the round or reads who
the closer took, averages the members' pseudo-gradients that pass their checks in job order (the
same sum on every leader: a malformed or non-finite one is left out everywhere) and takes the outer
step. A leader whose pseudo-gradient the round averaged is a member even when it looks after the
round was published; a leader that missed the close takes the newest published state instead. The job's first region (else the
closer) publishes the new state for rejoins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from geoshard.trainer.diloco import checks
from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.codec import codec
from geoshard.trainer.diloco.kv import KV, POLL_S, OuterSyncError
from geoshard.trainer.diloco.optimizer import OuterOptimizer
from geoshard.trainer.diloco.record import RoundRecord
from geoshard.trainer.diloco.roster import Roster
from geoshard.trainer.diloco.settings import OuterSync

log = logging.getLogger(__name__)

RECHECK_S = 1.0  # while a leader waits: how often it looks whether a region it waits for has finished


class Exchange:
    """A region leader's side of the rounds; it updates the outer state only, never the model."""

    def __init__(self, kv: KV, sync: OuterSync, region: str, regions: Sequence[str], opt: OuterOptimizer, device: torch.device) -> None:
        self.kv, self.sync, self.opt, self.device = kv, sync, opt, device
        self.region, self.regions = region, tuple(regions)
        self.roster = Roster(kv, regions)
        self._counted = 0  # refusals already in a record
        self._named: set[tuple[str, str]] = set()  # (region, kind) already in a warning

    def grad_key(self, r: int, region: str) -> str:
        return self.kv.key("r", r, "grad", region)

    def refused(self) -> int:
        """Values refused since the last record."""
        total = self.kv.signer.total()
        new, self._counted = total - self._counted, total
        return new

    def run(self, r: int, step: int, payload: bytes, t0: float) -> RoundRecord:
        """Round ``r`` in about six round trips to the store (it may be an ocean away) plus the
        pseudo-gradients' bytes."""
        published = len(payload)
        self.kv.put(self.grad_key(r, self.region), payload)
        entries, newest = self.roster.read()
        gone = Roster.gone(entries)
        closer = False
        if newest >= r:
            # Closed (and published) before this leader looked: still a member if its pseudo-gradient
            # was averaged in, and then it averages the same values as the others did.
            members = self.roster.members(r)
            if members is not None and not self.kv.store.check([self.grad_key(r, g) for g in members]):
                members = None  # forgotten since: this region is rounds behind
        else:
            members, closer, left = self._close(r, entries)
            gone |= left
        if members is None or self.region not in members:
            return self._adopt(r, step, payload, gone, t0)
        missing = tuple(g for g in self.regions if g not in members and g not in gone)
        read, left_out = self._average(r, members, payload)
        # Every member holds the same outer state; the job's first region publishes it (the launcher
        # hosts the store beside it, so the fp32 state crosses no ocean), else the closer.
        first = self.regions[0]
        if (self.region == first) if first in members else closer:
            published += self.opt.publish(self.kv, r, step)
            self.forget(r - 2)
        if missing:
            log.warning("DiLoCo: outer round %d averaged over %s; missing %s", r, ", ".join(members), ", ".join(missing))
        elapsed = time.perf_counter() - t0
        return RoundRecord(
            r, step, members, missing, elapsed, published, read, self.sync.compression, refused=self.refused(), left_out=left_out
        )

    def _close(self, r: int, entries: dict[str, str]) -> tuple[tuple[str, ...] | None, bool, set[str]]:
        """The round's members (None: not closed in time), whether this leader closed it, and the
        regions that left while it waited."""
        expected = Roster.expected(entries, r)
        timeout = self.sync.round_timeout_s
        ready, left = self._await(r, expected)
        if self.kv.store.add(self.kv.key("r", r, "close"), 1) == 1:
            return self.roster.close(r, [g for g in expected if g not in left], ready.__contains__, entries), True, left
        if self.kv.wait_all([self.roster.members_key(r)], timeout):
            return self.roster.members(r, closed=True), False, left
        return None, False, left

    def _await(self, r: int, expected: list[str]) -> tuple[set[str], set[str]]:
        """At most ``round_timeout_s``: the expected regions whose signed pseudo-gradient is there,
        and those that finished their steps meanwhile (not waited for any longer)."""
        deadline = time.monotonic() + self.sync.round_timeout_s
        ready: set[str] = set()
        left: set[str] = set()
        while waiting := [g for g in expected if g not in ready and g not in left]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            every = self.kv.wait_all([self.grad_key(r, g) for g in waiting], min(remaining, RECHECK_S))
            there = waiting if every else [g for g in waiting if self.kv.store.check([self.grad_key(r, g)])]
            for g, raw in zip(there, self.kv.get_many([self.grad_key(r, g) for g in there]), strict=True):
                try:
                    self.kv.head(self.grad_key(r, g), raw, self.opt.bounds.grad_bytes)
                    ready.add(g)
                except Refused as e:  # planted, or torn: the region's own value may still overwrite it
                    self.kv.signer.refuse(self.grad_key(r, g), e, raw)
            late = [g for g in waiting if g not in ready]
            left |= Roster.gone(self.roster.entries(late)) if late else set()
            if late and len(there) == len(waiting):
                time.sleep(POLL_S)  # every key is there but some are refused: wait_all would not wait
        return ready, left

    def _adopt(self, r: int, step: int, payload: bytes, gone: set[str], t0: float) -> RoundRecord:
        """Too late for round ``r``: take the newest published result, and go on from there."""
        published = len(payload)
        got = self.opt.adopt_latest(self.kv, r, self.device)
        if isinstance(got, Refused):
            # Keep this region's own parameters: the outer ones minus its pseudo-gradient (as sent).
            try:
                own = codec(self.sync.compression).decode(payload, self.opt.bounds.numel)
                self.opt.params.sub_(own.to(self.opt.params.device))
            except Refused:
                pass  # its own was not finite (codec.unusable): it keeps the outer parameters
            self.roster.announce(self.region, r + 1)
            log.warning(
                "DiLoCo: region %s missed outer round %d and refused its published state (%s: %s); it keeps its own parameters",
                self.region,
                r,
                got.kind,
                got.reason,
            )
            elapsed = time.perf_counter() - t0
            return RoundRecord(r, step, (), (), elapsed, published, 0, self.sync.compression, adopted=True, refused=self.refused())
        adopted, _, nbytes = got
        self.roster.announce(self.region, adopted + 1)
        log.warning("DiLoCo: region %s missed outer round %d; it continues from round %d's published state", self.region, r, adopted)
        took = self.roster.members(adopted)  # the record describes the round whose result this region now holds
        missing = tuple(g for g in self.regions if took is not None and g not in took and g not in gone)
        elapsed = time.perf_counter() - t0
        comp, refused = self.sync.compression, self.refused()
        return RoundRecord(adopted, step, took or (), missing, elapsed, published, nbytes, comp, adopted=True, refused=refused)

    def _average(self, r: int, members: tuple[str, ...], payload: bytes) -> tuple[int, tuple[tuple[str, str], ...]]:
        """The outer step with the mean of the members' pseudo-gradients that pass their checks
        (the same on every leader: the same bytes, the same checks); the bytes read from the others
        and the regions left out, with why."""
        bounds = self.opt.bounds
        others = [g for g in members if g != self.region]
        fetched = dict(zip(others, self.kv.fetch([self.grad_key(r, g) for g in others], bounds.grad_bytes), strict=True))
        total = torch.zeros_like(self.opt.params)
        read, used, left_out = 0, 0, []
        for g in members:  # job order: every leader sums the same values in the same order
            value = payload if g == self.region else fetched[g]
            try:
                if isinstance(value, Refused):
                    raise value
                read += len(value) if g != self.region else 0
                total += checks.grad(value, bounds).to(total.device)
                used += 1
            except Refused as e:
                self._leave_out(r, g, e, b"" if isinstance(value, Refused) else value)
                left_out.append((g, f"{e.kind}: {e.reason}"))
        if used:
            self.opt.step(total / used)
        return read, tuple(left_out)

    def _leave_out(self, r: int, region: str, why: Refused, raw: bytes) -> None:
        self.kv.signer.refuse(self.grad_key(r, region), why, raw, log_it=False)
        if (region, why.kind) not in self._named:
            self._named.add((region, why.kind))
            log.warning(
                "DiLoCo: outer round %d leaves out %s's pseudo-gradient (%s: %s; key %s) and averages the others; "
                "later rounds that leave it out for the same reason are in the rounds file, not logged",
                r,
                region,
                why.kind,
                why.reason,
                self.grad_key(r, region),
            )

    def forget(self, r: int) -> None:
        """Drop an old round's keys, where the store can (the newest state stays for rejoins)."""
        if r < 1:
            return
        chunked = [self.kv.key("state", r), *(self.grad_key(r, g) for g in self.regions)]
        self.kv.delete([self.roster.members_key(r), self.kv.key("r", r, "close")], chunked)


@dataclass
class Pending:
    """A round whose exchange runs behind training (``overlap_steps`` > 0)."""

    step: int
    apply_at: int
    snapshot: torch.Tensor | None = None  # the leader's parameters when the round started
    params: torch.Tensor | None = None  # p2p: the round's new outer parameters, set by its thread
    momentum: torch.Tensor | None = None  # this rank's outer momentum when the round started (for checkpoints)
    momentum_kept: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    record: RoundRecord | None = None
    error: BaseException | None = None
    blocked_s: float = 0.0

    def run_behind(self, work: Callable[[], RoundRecord], name: str) -> None:
        """``work`` in a thread of its own; ``result()`` hands its record, or its error, to the caller."""

        def run() -> None:
            try:
                self.record = work()
            except BaseException as e:  # handed to the training thread in result()
                self.error = e

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def keep_momentum(self, momentum: torch.Tensor | None) -> None:
        """In the round's thread, before the round changes it: a copy of the momentum (off the
        training thread's path), for a checkpoint taken while the round is in flight."""
        self.momentum = None if momentum is None else momentum.clone()
        self.momentum_kept.set()

    def kept_momentum(self) -> torch.Tensor | None:
        """The momentum as it was when the round started (waits for the thread's copy)."""
        if self.thread is not None and not self.momentum_kept.wait(timeout=600):
            raise OuterSyncError("DiLoCo: the round's thread did not copy the outer momentum within 600 s")
        return self.momentum

    def result(self) -> RoundRecord:
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.record is not None
        return self.record
