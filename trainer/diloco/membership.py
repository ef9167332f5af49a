"""Who takes part in a peer-to-peer round, decided through the store by the region leaders.

Each leader sets its small signed ``ready`` key for the round's attempt, waits for the regions
it expects, and the first leader done waiting closes the attempt (an atomic ``add``): it writes
the attempt's ``since`` (the round and attempt from which this exact set of members has held: the
name of their gloo groups, so groups are rebuilt only when the set changes), then its members. A
leader whose ready key the closer saw is a member, however late it reads the result; one that was
not seen sits the round out. Only small keys cross the store.

Attempt 0 waits for the regions the roster expects, at most ``round_timeout_s``. When an attempt's
exchange fails (a member lost mid-round: its sockets close and gloo raises at once on its peers, or
it hangs and the groups' timeout, ``round_timeout_s``, passes), the survivors redo the round as
attempt 1, 2, ...: each waits at most ``REDO_WAIT_S`` for the previous attempt's members, and the
closer marks those that did not come lost (``-1`` in the roster) and leaves them out. A member lost
mid-exchange is thus out of the next attempt within ``REDO_WAIT_S`` plus one store round trip
after the failure shows (its deadline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from geoshard.trainer.diloco import checks
from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.kv import KV, POLL_S
from geoshard.trainer.diloco.roster import Roster, checked_members

RECHECK_S = 1.0  # while a leader waits: how often it looks whether a region it waits for has finished
REDO_WAIT_S = 5.0  # a redone attempt waits this long for the previous attempt's members
MAX_ATTEMPTS = 4  # attempts of one round before the region keeps its own parameters for it


@dataclass(frozen=True)
class Decision:
    """An attempt's members (job order) and their groups' name; ``member``: whether this region is one."""

    members: tuple[str, ...]
    name: str  # "<round>.<attempt>" from which this set of members has held
    member: bool
    gone: frozenset[str] = frozenset()  # regions that finished their steps (not missing)
    fresh: tuple[str, ...] = ()  # members that rejoined: they contribute nothing and receive the outer state


def last_round(kv: KV) -> int:
    """The newest round a closer closed (0: none yet): where a region that rejoins starts counting."""
    key = kv.key("p2p", "round")
    value = kv.get(key)
    try:
        return 0 if value is None else checks.parse_round(value)
    except Refused as e:
        kv.signer.refuse(key, e, value or b"")
        return 0


class Membership:
    def __init__(self, kv: KV, regions: Sequence[str], region: str, timeout_s: float, shards: int) -> None:
        self.kv, self.regions, self.region, self.timeout_s, self.shards = kv, tuple(regions), region, timeout_s, shards
        self.roster = Roster(kv, regions)
        self.due = 0  # a round whose keys this leader forgets after its exchange (0: none)

    def _key(self, r: int, attempt: int, *names: object) -> str:
        return self.kv.key("r", r, attempt, *names)

    def members_key(self, r: int, attempt: int) -> str:
        return self._key(r, attempt, "members")

    def decide(self, r: int, attempt: int = 0, previous: Sequence[str] = (), fresh: bool = False) -> Decision:
        """The leader's part of round ``r``'s ``attempt`` (``previous``: the failed attempt's members;
        ``fresh``: this region rejoined and needs the outer state)."""
        self.kv.set(self._key(r, attempt, "ready", self.region), "fresh" if fresh else "1")
        entries = self.roster.entries(self.regions)  # no `latest`: nothing is published through the store
        gone = Roster.gone(entries)
        if attempt == 0:
            expected, wait_s = Roster.expected(entries, r), self.timeout_s
        else:
            expected, wait_s = [g for g in previous if g not in gone], REDO_WAIT_S
        return self._settle(r, attempt, expected, wait_s, self.timeout_s, entries, gone)

    def decide_first(self, source: str, join_timeout_s: float) -> Decision:
        """Round 0 peer to peer (a fresh or wholly resumed job): which regions take ``source``'s
        parameters (the job's first region, which created the job) over the shards' groups. Every
        job region is expected, for up to ``join_timeout_s`` (the regions' start-up skew: a later
        round has H steps of slack for it, round 0 none); it closes as soon as all are ready. A
        region that comes after round 0 closed (late, or restarted since) is not a member: it takes
        the outer state in its first round instead."""
        if self.kv.store.check([self.members_key(0, 0)]):  # closed before its ready key: it cannot be a member
            closed = self._closed(0, 0)
            return Decision(() if closed is None else closed[0], "0.0", False, frozenset(), ())
        self.kv.set(self._key(0, 0, "ready", self.region), "1" if self.region == source else "fresh")
        entries = self.roster.entries(self.regions)  # no `latest`: nothing is published through the store
        gone = Roster.gone(entries)
        expected = [g for g in self.regions if g not in gone]
        return self._settle(0, 0, expected, join_timeout_s, join_timeout_s, entries, gone)

    def _settle(
        self, r: int, attempt: int, expected: list[str], wait_s: float, close_wait_s: float, entries: dict[str, str], gone: set[str]
    ) -> Decision:
        """The attempt's decision once this leader's ready key is set: the closed attempt if it is
        (read once), else up to ``wait_s`` for the ``expected`` regions, then close it (the first
        leader to come) or wait up to ``close_wait_s`` for whoever closes it."""
        closed = self._closed(r, attempt) if self.kv.store.check([self.members_key(r, attempt)]) else None
        if closed is None:
            ready, left = self._await(r, attempt, expected, wait_s)
            gone |= left
            if self.kv.store.add(self._key(r, attempt, "close"), 1) == 1:
                closed = self._close(r, attempt, [g for g in expected if g not in left], ready, entries)
            elif self.kv.wait_all([self.members_key(r, attempt)], close_wait_s):
                closed = self._closed(r, attempt)
        if closed is None:  # not closed within the wait, or its members refused
            return Decision((), f"{r}.{attempt}", False, frozenset(gone), ())
        members, name, rejoined = closed
        return Decision(members, name, self.region in members, frozenset(gone), rejoined)

    def _closed(self, r: int, attempt: int) -> tuple[tuple[str, ...], str, tuple[str, ...]] | None:
        """A closed attempt's members, groups' name and rejoined regions, in one round trip (the
        closer sets the name and the rejoined before the members: they are there); None when refused."""
        keys = [self.members_key(r, attempt), self._key(r, attempt, "since"), self._key(r, attempt, "fresh")]
        value, since, fresh = self.kv.open_many(keys)
        members = None if value is None else checked_members(self.kv, keys[0], value, self.regions)
        if members is None:
            return None
        rejoined = tuple(g for g in (fresh or b"").decode("ascii", errors="replace").split(",") if g in members)
        return members, self._parse_since(keys[1], since, r, attempt), rejoined

    def _close(
        self, r: int, attempt: int, expected: list[str], ready: dict[str, bytes], entries: dict[str, str]
    ) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
        members = tuple(g for g in self.regions if g in expected and g in ready)
        fresh = [g for g in members if ready[g] == b"fresh"]
        if len(fresh) == len(members):  # nobody to take the state from: they start over from their own
            fresh = []
        for g in expected:
            if g not in members:  # lost, or too slow: not waited for again until it announces itself
                self.roster.mark_lost(g, entries.get(g, ""))
        last = self._last(r - 1) if attempt == 0 and r > 0 else None  # round 1 reuses round 0's groups
        # the previous round's groups serve again when its last attempt had these members and did not fail
        reuse = last is not None and self._members(r - 1, last) == members and not self.kv.store.check([self._key(r - 1, last, "failed")])
        since = self._read_since(r - 1, last) if reuse and last is not None else f"{r}.{attempt}"
        self.kv.set(self._key(r, attempt, "since"), since)  # before the members: whoever sees them finds them
        self.kv.set(self._key(r, attempt, "fresh"), ",".join(fresh))
        self.kv.set(self.members_key(r, attempt), ",".join(members))
        self.kv.set(self.kv.key("p2p", "round"), str(r))  # where a region that rejoins starts counting
        if attempt == 0:
            self.due = r - 2  # forgotten by tidy(), after the exchange: not on the round's way
        return members, since, tuple(fresh)

    def tidy(self) -> None:
        """Forget what the last close left for later (the leader calls it after its round)."""
        due, self.due = self.due, 0
        self.forget(due)

    def _last(self, r: int) -> int | None:
        """The last attempt of round ``r`` that was closed."""
        last = None
        for attempt in range(MAX_ATTEMPTS):
            if not self.kv.store.check([self.members_key(r, attempt)]):
                break
            last = attempt
        return last

    def mark_failed(self, r: int, attempt: int) -> None:
        """This attempt's exchange failed here: its groups are not reused."""
        self.kv.set(self._key(r, attempt, "failed"), "1")

    def _members(self, r: int, attempt: int) -> tuple[str, ...] | None:
        key = self.members_key(r, attempt)
        value = self.kv.get(key)
        return None if value is None else checked_members(self.kv, key, value, self.regions)

    def _read_since(self, r: int, attempt: int) -> str:
        key = self._key(r, attempt, "since")
        return self._parse_since(key, self.kv.get(key), r, attempt)

    def _parse_since(self, key: str, value: bytes | None, r: int, attempt: int) -> str:
        try:
            if value is None:
                raise Refused("malformed", "missing")
            a, dot, b = value.decode("ascii", errors="replace").partition(".")
            checks.parse_round(a.encode()), checks.parse_round(b.encode())
            if not dot:
                raise Refused("malformed", f"{value[:40]!r} is not ROUND.ATTEMPT")
            return f"{int(a)}.{int(b)}"
        except Refused as e:
            if value is not None:
                self.kv.signer.refuse(key, e, value)
            return f"{r}.{attempt}"

    def _await(self, r: int, attempt: int, expected: list[str], wait_s: float) -> tuple[dict[str, bytes], set[str]]:
        """At most ``wait_s``: the expected regions whose signed ready key is there (with its value),
        and those that finished their steps meanwhile."""
        deadline = time.monotonic() + wait_s
        ready: dict[str, bytes] = {}
        left: set[str] = set()
        while waiting := [g for g in expected if g not in ready and g not in left]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            keys = [self._key(r, attempt, "ready", g) for g in waiting]
            every = self.kv.wait_all(keys, min(remaining, RECHECK_S))
            there = waiting if every else [g for g, k in zip(waiting, keys, strict=True) if self.kv.store.check([k])]
            for g, value in zip(there, self.kv.open_many([self._key(r, attempt, "ready", g) for g in there]), strict=True):
                if value is not None:
                    ready[g] = value
            late = [g for g in waiting if g not in ready]
            left |= Roster.gone(self.roster.entries(late)) if late else set()
            if late and len(there) == len(waiting):
                time.sleep(POLL_S)  # every key is there but some are refused: wait_all would not wait
        return ready, left

    def forget(self, r: int) -> None:
        """Drop an old round's small keys (every attempt's), where the store can."""
        if r < 1:
            return
        plain = []
        for attempt in range(MAX_ATTEMPTS):
            if not self.kv.store.check([self._key(r, attempt, "close")]):
                break
            name = self._read_since(r, attempt)
            plain += [self._key(r, attempt, "mac", name, s, g) for s in range(self.shards) for g in self.regions]
            plain += [self._key(r, attempt, k) for k in ("members", "close", "since", "failed", "fresh")]
            plain += [self._key(r, attempt, "ready", g) for g in self.regions]
        self.kv.delete(plain, [])
