"""The roster: which regions a round waits for, and which regions a round averaged.

Each region's entry in the store: ``R`` (expected from round R on), ``-1`` (waited for in vain;
expected again once it announces itself with a round number), ``left`` (finished its steps: no
longer waited for, nor counted missing). The first leader done waiting closes a round: an atomic
``add`` picks that one closer, which writes the round's members, so every leader averages over the
same set. The closer marks a region it waited for in vain with a compare-and-set, so that a region
that left meanwhile stays ``left``. Every entry is signed (``auth``); one that is refused counts as
``-1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.kv import KV

LEFT = "left"
LOST = "-1"


class Roster:
    def __init__(self, kv: KV, regions: Sequence[str]) -> None:
        self.kv = kv
        self.regions = tuple(regions)

    def _key(self, region: str) -> str:
        return self.kv.key("roster", region)

    def members_key(self, r: int) -> str:
        return self.kv.key("r", r, "members")

    def start(self) -> None:
        """A fresh job: every region is expected from round 1 (until it is waited for in vain), and
        round 0 (the first region's parameters) has them all."""
        for g in self.regions:
            self.announce(g, 1)
        self.kv.set(self.members_key(0), ",".join(self.regions))

    def announce(self, region: str, from_round: int) -> None:
        """``region`` takes part from round ``from_round`` on."""
        self.kv.set(self._key(region), str(from_round))

    def leave(self, region: str) -> None:
        self.kv.set(self._key(region), LEFT)

    def read(self) -> tuple[dict[str, str], int]:
        """Every region's entry and the newest published round (-1 when refused), in one round trip."""
        keys = [self._key(g) for g in self.regions] + [self.kv.key("latest")]
        values = [(v or LOST.encode()).decode("ascii", errors="replace") for v in self.kv.open_many(keys)]
        newest = values[-1]
        return dict(zip(self.regions, values[:-1], strict=True)), int(newest) if newest.isdigit() else -1

    def entries(self, regions: Sequence[str]) -> dict[str, str]:
        """The entries of ``regions`` now."""
        values = self.kv.open_many([self._key(g) for g in regions])
        return {g: (v or LOST.encode()).decode("ascii", errors="replace") for g, v in zip(regions, values, strict=True)}

    @staticmethod
    def expected(entries: dict[str, str], r: int) -> list[str]:
        """The regions round ``r`` waits for."""
        return [g for g, v in entries.items() if v.isdigit() and int(v) <= r]

    @staticmethod
    def gone(entries: dict[str, str]) -> set[str]:
        return {g for g, v in entries.items() if v == LEFT}

    def close(self, r: int, expected: Sequence[str], present: Callable[[str], bool], entries: dict[str, str]) -> tuple[str, ...]:
        """On the closer: the expected regions ``present`` now are the round's members; the others
        are not waited for again until they announce themselves (unless they left meanwhile)."""
        members = tuple(g for g in self.regions if g in expected and present(g))
        for g in expected:
            if g not in members:  # lost, or too slow
                self.mark_lost(g, entries[g])
        self.kv.set(self.members_key(r), ",".join(members))  # last: a late region re-announces only after this
        return members

    def mark_lost(self, region: str, seen: str) -> None:
        """``region`` was waited for in vain: ``-1``, unless its entry changed from ``seen`` meanwhile."""
        key = self._key(region)
        compare_set = getattr(self.kv.store, "compare_set", None)
        if compare_set is None:
            self.kv.set(key, LOST)
            return
        # Only over the entry the closer read: a region that left (or announced itself) since keeps its word.
        old, new = self.kv.signer.sign(key, seen.encode()), self.kv.signer.sign(key, LOST.encode())
        compare_set(key, old.decode(), new.decode())

    def members(self, r: int, *, closed: bool = False) -> tuple[str, ...] | None:
        """Round ``r``'s members; None while it is open (or when its value is refused). ``closed``:
        the caller saw it closed (one round trip fewer)."""
        key = self.members_key(r)
        value = self.kv.opened(key, self.kv.store.get(key)) if closed else self.kv.get(key)
        return None if value is None else checked_members(self.kv, key, value, self.regions)


def checked_members(kv: KV, key: str, value: bytes, regions: Sequence[str]) -> tuple[str, ...] | None:
    """A members value (``a,b,c``) read from the store: the names, or None (refused and counted)
    when one is not a region of the job."""
    names = tuple(g for g in value.decode("ascii", errors="replace").split(",") if g)
    if not set(names) <= set(regions):
        kv.signer.refuse(key, Refused("malformed", f"members {','.join(names)[:80]!r} are not the job's regions"), value)
        return None
    return names
