"""One outer round on a region leader, and the thread that runs it behind training.

The leader publishes its compressed pseudo-gradient, waits (at most ``round_timeout_s``) for the
regions the roster expects, closes the round or reads who the closer took, averages the members'
pseudo-gradients in job order (the same sum on every leader) and takes the outer step. A leader
that missed the close takes the newest published state instead. The job's first region (else the
closer) publishes the new state for rejoins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from geoshard.trainer.diloco.kv import KV, OuterSyncError, parts
from geoshard.trainer.diloco.optimizer import OuterOptimizer
from geoshard.trainer.diloco.record import RoundRecord
from geoshard.trainer.diloco.roster import Roster
from geoshard.trainer.diloco.settings import OuterSync, decode

log = logging.getLogger(__name__)


class Exchange:
    """A region leader's side of the rounds; it updates the outer state only, never the model."""

    def __init__(self, kv: KV, sync: OuterSync, region: str, regions: Sequence[str], opt: OuterOptimizer, device: torch.device) -> None:
        self.kv, self.sync, self.opt, self.device = kv, sync, opt, device
        self.region, self.regions = region, tuple(regions)
        self.roster = Roster(kv, regions)

    def grad_key(self, r: int, region: str) -> str:
        return self.kv.key("r", r, "grad", region)

    def run(self, r: int, step: int, payload: bytes, t0: float) -> RoundRecord:
        """Round ``r`` in about six round trips to the store (it may be an ocean away) plus the
        pseudo-gradients' bytes."""
        published = len(payload)
        self.kv.put(self.grad_key(r, self.region), payload)
        entries, newest = self.roster.read()
        gone = Roster.gone(entries)
        # newest >= r: this region is rounds behind; the round closed and may be forgotten.
        members, closer = self._close(r, entries) if newest < r else (None, False)
        if members is None or self.region not in members:
            return self._adopt(r, step, published, gone, t0)
        missing = tuple(g for g in self.regions if g not in members and g not in gone)
        read = self._average(r, members, payload)
        # Every member holds the same outer state; the job's first region publishes it (the launcher
        # hosts the store beside it, so the fp32 state crosses no ocean), else the closer.
        first = self.regions[0]
        if (self.region == first) if first in members else closer:
            published += self.opt.publish(self.kv, r, step)
            self.forget(r - 2)
        if missing:
            log.warning("DiLoCo: outer round %d averaged over %s; missing %s", r, ", ".join(members), ", ".join(missing))
        return RoundRecord(r, step, members, missing, time.perf_counter() - t0, published, read, self.sync.compression)

    def _close(self, r: int, entries: dict[str, str]) -> tuple[tuple[str, ...] | None, bool]:
        """The round's members (None: not closed in time) and whether this leader closed it."""
        expected = Roster.expected(entries, r)
        timeout = self.sync.round_timeout_s
        self.kv.wait_all([self.grad_key(r, g) for g in expected], timeout)
        if self.kv.store.add(self.kv.key("r", r, "close"), 1) == 1:
            return self.roster.close(r, expected, lambda g: self.kv.store.check([self.grad_key(r, g)])), True
        if self.kv.wait_all([self.roster.members_key(r)], timeout):
            return self.roster.members(r, closed=True), False
        return None, False

    def _adopt(self, r: int, step: int, published: int, gone: set[str], t0: float) -> RoundRecord:
        """Too late for round ``r``: take the newest published result, and go on from there."""
        adopted, _, nbytes = self.opt.adopt_latest(self.kv, r, self.device)
        self.roster.announce(self.region, adopted + 1)
        log.warning("DiLoCo: region %s missed outer round %d; it continues from round %d's published state", self.region, r, adopted)
        took = self.roster.members(adopted)  # the record describes the round whose result this region now holds
        missing = tuple(g for g in self.regions if took is not None and g not in took and g not in gone)
        elapsed = time.perf_counter() - t0
        return RoundRecord(adopted, step, took or (), missing, elapsed, published, nbytes, self.sync.compression, adopted=True)

    def _average(self, r: int, members: tuple[str, ...], payload: bytes) -> int:
        """The outer step with the members' mean pseudo-gradient; the bytes read from the others."""
        compression = self.sync.compression
        others = [g for g in members if g != self.region]
        nparts = parts(len(payload))  # every region's pseudo-gradient has this size (checked at join)
        received = dict(zip(others, self.kv.fetch([self.grad_key(r, g) for g in others], nparts), strict=True))
        total = torch.zeros_like(self.opt.params)
        read = 0
        for g in members:  # job order: every leader sums the same values in the same order
            if g == self.region:
                total += decode(payload, compression).to(total.device)
                continue
            other = received[g]
            read += len(other)
            if len(other) != len(payload):  # the contract check at join makes this a store gone wrong
                raise OuterSyncError(f"DiLoCo: region {g}'s pseudo-gradient for round {r} has {len(other)} bytes, expected {len(payload)}")
            total += decode(other, compression).to(total.device)
        self.opt.step(total / len(members))
        return read

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

    def result(self) -> RoundRecord:
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.record is not None
        return self.record
