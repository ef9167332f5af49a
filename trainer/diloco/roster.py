"""The roster: which regions a round waits for, and which regions a round averaged.

Each region's entry in the store: ``R`` (expected from round R on), ``-1`` (waited for in vain;
expected again once it announces itself with a round number), ``left`` (finished its steps: no
longer waited for, nor counted missing). The first leader done waiting closes a round: an atomic
``add`` picks that one closer, which writes the round's members, so every leader averages over the
same set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from geoshard.trainer.diloco.kv import KV

LEFT = "left"


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
        self.kv.store.set(self.members_key(0), ",".join(self.regions))

    def announce(self, region: str, from_round: int) -> None:
        """``region`` takes part from round ``from_round`` on."""
        self.kv.store.set(self._key(region), str(from_round))

    def leave(self, region: str) -> None:
        self.kv.store.set(self._key(region), LEFT)

    def read(self) -> tuple[dict[str, str], int]:
        """Every region's entry and the newest published round, in one round trip."""
        keys = [self._key(g) for g in self.regions] + [self.kv.key("latest")]
        values = [v.decode() for v in self.kv.get_many(keys)]
        return dict(zip(self.regions, values[:-1], strict=True)), int(values[-1])

    @staticmethod
    def expected(entries: dict[str, str], r: int) -> list[str]:
        """The regions round ``r`` waits for."""
        return [g for g, v in entries.items() if v.lstrip("-").isdigit() and 0 <= int(v) <= r]

    @staticmethod
    def gone(entries: dict[str, str]) -> set[str]:
        return {g for g, v in entries.items() if v == LEFT}

    def close(self, r: int, expected: Sequence[str], present: Callable[[str], bool]) -> tuple[str, ...]:
        """On the closer: the expected regions ``present`` now are the round's members; the others
        are not waited for again until they announce themselves."""
        members = tuple(g for g in self.regions if g in expected and present(g))
        for g in expected:
            if g not in members:  # lost, or too slow
                self.kv.store.set(self._key(g), "-1")
        self.kv.store.set(self.members_key(r), ",".join(members))  # last: a late region re-announces only after this
        return members

    def members(self, r: int, *, closed: bool = False) -> tuple[str, ...] | None:
        """Round ``r``'s members; None while it is open. ``closed``: the caller saw it closed (one round trip fewer)."""
        key = self.members_key(r)
        value = self.kv.store.get(key) if closed else self.kv.get_if(key)
        return None if value is None else tuple(value.decode().split(","))
