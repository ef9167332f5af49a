"""Who takes part in a peer-to-peer round, decided through the store by the region leaders.

Each leader sets its small signed ``ready`` key for the round, waits (at most ``round_timeout_s``)
for the regions the roster expects, and the first leader done waiting closes the round (an atomic
``add``): it writes the round's ``since`` (the round from which this exact set of members has
held: the name of their gloo groups, so groups are rebuilt only when the set changes) and then its
members. A leader whose ready key the closer saw is a member, however late it reads the result;
one that was not seen is told so and sits the round out. Only small keys cross the store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from geoshard.trainer.diloco import checks
from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.kv import KV, POLL_S
from geoshard.trainer.diloco.roster import Roster

RECHECK_S = 1.0  # while a leader waits: how often it looks whether a region it waits for has finished


@dataclass(frozen=True)
class Decision:
    """A round's members (job order) and ``since``; ``member``: whether this region is one."""

    members: tuple[str, ...]
    since: int
    member: bool
    gone: frozenset[str] = frozenset()  # regions that finished their steps (not missing)


class Membership:
    def __init__(self, kv: KV, regions: Sequence[str], region: str, timeout_s: float, shards: int) -> None:
        self.kv, self.regions, self.region, self.timeout_s, self.shards = kv, tuple(regions), region, timeout_s, shards
        self.roster = Roster(kv, regions)

    def ready_key(self, r: int, region: str) -> str:
        return self.kv.key("r", r, "ready", region)

    def since_key(self, r: int) -> str:
        return self.kv.key("r", r, "since")

    def decide(self, r: int) -> Decision:
        """The leader's part of round ``r``; None members when the round could not be read in time."""
        self.kv.set(self.ready_key(r, self.region), "1")
        entries, _ = self.roster.read()
        gone = Roster.gone(entries)
        members = self.roster.members(r) if self.kv.store.check([self.roster.members_key(r)]) else None
        if members is None:
            expected = Roster.expected(entries, r)
            ready, left = self._await(r, expected)
            gone |= left
            if self.kv.store.add(self.kv.key("r", r, "close"), 1) == 1:
                since = self._since(r, tuple(g for g in self.regions if g in ready))
                self.kv.set(self.since_key(r), str(since))  # before the members: whoever sees them finds it
                members = self.roster.close(r, [g for g in expected if g not in left], ready.__contains__, entries)
                self.forget(r - 2)
            elif self.kv.wait_all([self.roster.members_key(r)], self.timeout_s):
                members = self.roster.members(r, closed=True)
        since = self._read_since(r) if members is not None else r
        members = members or ()
        return Decision(members, since, self.region in members, frozenset(gone))

    def _since(self, r: int, members: tuple[str, ...]) -> int:
        prev = self.roster.members(r - 1) if r > 1 else None
        if prev == members:
            return self._read_since(r - 1)
        return r

    def _read_since(self, r: int) -> int:
        value = self.kv.get(self.since_key(r))
        if value is None:
            return r
        try:
            return checks.parse_round(value)
        except Refused as e:
            self.kv.signer.refuse(self.since_key(r), e, value)
            return r

    def _await(self, r: int, expected: list[str]) -> tuple[set[str], set[str]]:
        """At most ``timeout_s``: the expected regions whose signed ready key is there, and those
        that finished their steps meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        ready: set[str] = set()
        left: set[str] = set()
        while waiting := [g for g in expected if g not in ready and g not in left]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            keys = [self.ready_key(r, g) for g in waiting]
            every = self.kv.wait_all(keys, min(remaining, RECHECK_S))
            there = waiting if every else [g for g in waiting if self.kv.store.check([self.ready_key(r, g)])]
            for g, value in zip(there, self.kv.open_many([self.ready_key(r, g) for g in there]), strict=True):
                if value is not None:
                    ready.add(g)
            late = [g for g in waiting if g not in ready]
            left |= Roster.gone(self.roster.entries(late)) if late else set()
            if late and len(there) == len(waiting):
                time.sleep(POLL_S)  # every key is there but some are refused: wait_all would not wait
        return ready, left

    def forget(self, r: int) -> None:
        """Drop an old round's small keys, where the store can."""
        if r < 1:
            return
        name = f"m{self._read_since(r)}"  # the round's group name, in its MAC keys
        plain = [self.kv.key("r", r, "mac", name, s, g) for s in range(self.shards) for g in self.regions]
        plain += [self.roster.members_key(r), self.kv.key("r", r, "close"), self.since_key(r)]
        plain += [self.ready_key(r, g) for g in self.regions]
        self.kv.delete(plain, [])
