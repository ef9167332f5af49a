"""One outer round over the peer-to-peer transport, on every rank of a region.

The leader learns the round's members through the store (``membership``) and hands them to its
region's ranks (the exchange's own region group). Each rank then, for every shard it owns
(``shards``): takes its pseudo-gradient (outer shard minus the current parameters there), casts it
to the compression's dtype, publishes its MAC projections signed in the store (``mac``), sums it
with the other members' owners of that shard over gloo (``sharded``, ``streams`` chunks at once,
ring order), checks the sum against the published projections, and — when every rank of the region
found every shard sound (one flag all-reduced in the region) — divides by the members and takes the
outer Nesterov step on the shard. Then the region all-gathers the shards: every rank holds the new
parameters. A region that sits a round out (late) or refuses a sum keeps its own parameters for
that round. An exchange that fails (a peer lost mid-round: gloo raises, or its timeout passes) is
redone among the survivors as the round's next attempt (``membership``), up to ``MAX_ATTEMPTS``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch.distributed import BroadcastOptions

from geoshard.trainer.diloco import mac, state_auth
from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.codec import codec
from geoshard.trainer.diloco.groups import Bind, CountingStore, GroupCache, gloo_group
from geoshard.trainer.diloco.kv import KV, OuterSyncError
from geoshard.trainer.diloco.membership import MAX_ATTEMPTS, Decision, Membership, last_round
from geoshard.trainer.diloco.optimizer import OuterOptimizer
from geoshard.trainer.diloco.pipeline import Gather, Pipeline, one_thread
from geoshard.trainer.diloco.quantized import Quantized, round_sum
from geoshard.trainer.diloco.record import RoundRecord
from geoshard.trainer.diloco.ring import restrict
from geoshard.trainer.diloco.settings import SUMMABLE_DTYPES, OuterSync
from geoshard.trainer.diloco.sharded import Membership as Ring
from geoshard.trainer.diloco.sharded import ShardGroups, gather_in_region, make_groups, region_max, start_waves, wave_count
from geoshard.trainer.diloco.shards import Layout, shard_count

log = logging.getLogger(__name__)

OTHER_REFUSED = "another rank of the region refused its shard"

Corrupt = Callable[[int, int, torch.Tensor], None]  # (round, shard, contribution): tests only
OK, REFUSED, FAILED = 0, 1, 2  # an attempt's outcome on a rank; the region takes the worst
FETCH_STEP_S = 0.25  # the MAC projections' reader checks this often whether the exchange failed


class Phases:
    """Seconds per phase of one round on this rank (summed over its attempts), in first-use order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def tick(self, name: str) -> None:
        """The time since the last tick goes to ``name``."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now

    def record(self) -> tuple[tuple[str, float], ...]:
        return tuple(self.seconds.items())


class P2PExchange:
    """A rank's side of the peer-to-peer rounds: its shards of the outer state, its groups."""

    def __init__(
        self,
        store: CountingStore,
        kv: KV,
        sync: OuterSync,
        region: str,
        job: Sequence[tuple[str, int]],
        ring: Sequence[str],
        k: int,
        bind: Bind,
        numel: int,
        opt: OuterOptimizer,
        token: str,
        corrupt: Corrupt | None = None,
    ) -> None:
        self.store, self.kv, self.sync, self.region, self.bind = store, kv, sync, region, bind
        self.job, self.ring = dict(job), tuple(ring)
        self.layout = Layout(numel, shard_count(list(self.job.values())), self.job[region], k)
        self.opt, self.corrupt = opt, corrupt
        self.membership = Membership(kv, tuple(self.job), region, sync.round_timeout_s, self.layout.shards)
        self.cache = GroupCache()
        self.region_group: Any = None
        if self.layout.n > 1:  # its own group: the training thread's never carries the exchange
            wait_s = 2 * sync.round_timeout_s + 60  # non-leaders wait here while the leader waits on the store
            self.region_group = gloo_group(store, kv.key("pg", "region", region, token) + "/", k, self.layout.n, bind, wait_s)
        self.fresh = False  # rejoined: its next round contributes nothing and receives the outer state
        c = codec(sync.compression)  # int8 / fp8: its own exchange (quantized.py), with each owned shard's residual
        self.quantized = None if c.summable else Quantized(c, kv, sync.error_feedback, sync.round_timeout_s)
        self.phases = Phases()
        self._gather: Gather | None = None  # the attempt's staged gather (pipeline), made before it starts
        self._pipe: Pipeline | None = None  # the attempt's waves, once its values exist
        self._full: torch.Tensor | None = None  # the round's new parameters, when the staged gather made them

    # -- the outer shards -------------------------------------------------------------------------
    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shards of a full flat vector, concatenated."""
        return torch.cat([flat[slice(*self.layout.span(s))] for s in self.layout.mine])

    def _pieces(self, own: torch.Tensor) -> dict[int, torch.Tensor]:
        out, i = {}, 0
        for s in self.layout.mine:
            a, b = self.layout.span(s)
            out[s] = own[i : i + b - a]
            i += b - a
        return out

    # -- one round ----------------------------------------------------------------------------------
    def run(self, r: int, step: int, current: torch.Tensor, t0: float) -> tuple[RoundRecord, torch.Tensor]:
        """Round ``r`` from this rank's current parameters (flat fp32): its record and the new full parameters."""
        carried0, refused0 = self.store.carried, self.kv.signer.total()
        self.phases = Phases()
        self._full = None
        sent, left_out, previous, adopted = 0, tuple[tuple[str, str], ...](), tuple[str, ...](), False
        for attempt in range(MAX_ATTEMPTS):
            d = self._decide(r, attempt, previous)
            adopted = self.region in d.fresh
            if not d.member:
                log.warning("DiLoCo: region %s missed outer round %d; it keeps its own parameters for it", self.region, r)
                self.opt.reset(self.own(current), self.opt.momentum())
                if self.layout.k == 0:
                    self.membership.roster.announce(self.region, r + 1)
                break
            n, code, why = self._member(r, attempt, d, current)
            sent += n
            if code == OK:
                self.fresh = self.fresh and not adopted
                break
            if code == REFUSED or attempt == MAX_ATTEMPTS - 1:
                self.opt.reset(self.own(current), self.opt.momentum())
                left_out = ((self.region, why),)
                log.warning("DiLoCo: region %s refuses outer round %d (%s); it keeps its own parameters for it", self.region, r, why)
                break
            log.warning("DiLoCo: outer round %d attempt %d among %s failed (%s); the others redo it", r, attempt, ", ".join(d.members), why)
            previous = d.members
        self.phases.tick("other")
        if self._full is not None:  # the staged step's gather ran while the waves travelled
            full, gathered = self._full, (self.layout.n - 1) * 4 * self.layout.own_numel
        else:
            full, gathered = gather_in_region(self.region_group, self.layout, self._pieces(self.opt.params))
        self.phases.tick("gather")
        if self.layout.k == 0:
            self.membership.tidy()  # old rounds' keys, once this round no longer waits on the store
        missing = tuple(g for g in self.job if g not in d.members and g not in d.gone)
        rec = RoundRecord(r, step, d.members, missing, time.perf_counter() - t0, sent + gathered, 0, self.sync.compression)
        refused = self.kv.signer.total() - refused0
        adopted = adopted and not left_out
        store_bytes = self.store.carried - carried0
        rec = replace(rec, adopted=adopted, refused=refused, left_out=left_out, transport="p2p", store_bytes=store_bytes)
        return replace(rec, phases=self.phases.record()), full

    # -- round 0 ------------------------------------------------------------------------------------
    def first_round(self, source: str, current: torch.Tensor, join_timeout_s: float) -> tuple[torch.Tensor, int, int]:
        """Round 0 (a fresh or wholly resumed job): every region starts from ``source``'s parameters
        (the job's first region: its own, or its checkpoint's). ``source``'s owners broadcast their
        fp32 shards on the shards' groups (round 1 reuses them while its members are the same), the
        other member regions' owners take them, and each region gathers them: the store carries the
        membership and the groups' rendezvous only. The full parameters, the bytes this rank
        received across regions, and the round the region starts from (0). A region that came
        after round 0 closed keeps ``current``, starts from the newest closed round (as a region
        that rejoins does) and takes the outer state in its first round (``fresh``)."""
        if self.region == source and self.layout.k == 0:  # before its ready key: whoever sees it a member finds it
            self.kv.set(self.kv.key("r", 0, 0, "momentum"), "1" if self.opt.momentum() is not None else "0")
        d = self._decide(0, 0, (), lambda: self.membership.decide_first(source, join_timeout_s))
        if source not in d.members:
            raise OuterSyncError(
                f"DiLoCo: outer round 0 closed without {source}, whose parameters every region starts from "
                f"(it did not come within {join_timeout_s:g} s); start the job again"
            )
        if not d.member:
            log.warning("DiLoCo: region %s came after outer round 0 closed; it takes the outer state in its first round", self.region)
            self.fresh = True
            last = last_round(self.kv) if self.layout.k == 0 else 0  # rounds may have closed since round 0
            if self.layout.k == 0:
                self.membership.roster.announce(self.region, last + 1)
            self.opt.reset(self.own(current), None)
            return current, 0, region_max(self.region_group, last)
        own = self._pieces(self.own(current))
        mom = self._momentum_of(source)
        received = 0
        if len(d.members) > 1:
            ring = Ring(tuple((g, self.job[g]) for g in restrict(self.ring, d.members)), f"m{d.name}")
            timeout = self.sync.round_timeout_s
            args = (self.region, self.sync.streams, self.bind, timeout, self.cache)
            groups = ShardGroups(self.store, self.kv.key("pg"), self.layout, ring, *args)
            try:
                make_groups(groups, self.layout.mine)

                def pieces(s: int) -> list[torch.Tensor]:  # the parameters' chunks, then the momentum's
                    return [t[a:b] for t in (own[s], *([mom[s]] if mom else [])) for a, b in groups.pieces(s)]

                if self.region == source:
                    for s in self.layout.mine:
                        state_auth.publish(self.kv, self.kv.key("r", 0, 0, "state", s), pieces(s))
                        if self.corrupt is not None:  # tests: a change made on the wire, after the digests
                            self.corrupt(0, s, own[s])
                works = []
                for s in self.layout.mine:
                    for i, t in enumerate(pieces(s)):
                        opts = BroadcastOptions()
                        opts.rootRank = ring.index(source)
                        works.append(groups.group(s, i % len(groups.pieces(s))).broadcast([t], opts))
                for w in works:
                    w.wait()
            except RuntimeError as e:  # a peer lost while round 0 travelled: the job starts again
                if self.layout.k == 0:
                    self.membership.mark_failed(0, 0)
                raise OuterSyncError(f"DiLoCo: outer round 0 from {source} failed: {str(e).strip()[:160]}") from None
            received = 0 if self.region == source else 4 * self.layout.own_numel * (2 if mom else 1)
            if self.region != source:
                sent_to_us = [(self.kv.key("r", 0, 0, "state", s), pieces(s)) for s in self.layout.mine]
                why = state_auth.check_all(self.kv, sent_to_us, timeout)
                if region_max(self.region_group, int(bool(why))):
                    raise OuterSyncError(f"DiLoCo: outer round 0 from {source}: refused ({why or OTHER_REFUSED})")
        bad = sum(int((~torch.isfinite(t)).sum()) for t in (*own.values(), *mom.values()))
        if region_max(self.region_group, int(bad > 0)):
            raise OuterSyncError(f"DiLoCo: outer round 0 from {source}: parameters that are NaN or infinite arrived; refused")
        momentum = torch.cat([mom[s] for s in self.layout.mine]) if mom else None
        self.opt.reset(torch.cat([own[s] for s in self.layout.mine]), momentum)
        full, _ = gather_in_region(self.region_group, self.layout, self._pieces(self.opt.params))
        return full, received, 0

    def _momentum_of(self, source: str) -> dict[int, torch.Tensor]:
        """Round 0: the source region's outer momentum shards, which it sends with its parameters (a
        whole job resumed from checkpoints that hold it: resume.py), or {} (a fresh job: zero). The
        source's leader says which under a signed key before round 0 closes; every rank of every
        member region learns it (this rank's buffers to send or to receive into)."""
        key = self.kv.key("r", 0, 0, "momentum")
        held = self.opt.momentum()
        has = 0
        if self.layout.k == 0:
            if self.region == source:
                has = int(held is not None)
            elif not self.kv.wait_all([key], self.sync.round_timeout_s) or (value := self.kv.open_many([key])[0]) not in (b"0", b"1"):
                raise OuterSyncError(f"DiLoCo: outer round 0 from {source}: refused ({key} is missing, unsigned or not 0 or 1)")
            else:
                has = int(value == b"1")
        if not region_max(self.region_group, has):
            return {}
        if self.region == source:
            assert held is not None
            return self._pieces(held)
        return {s: torch.zeros(b - a) for s in self.layout.mine for a, b in [self.layout.span(s)]}

    def _decide(self, r: int, attempt: int, previous: tuple[str, ...], first: Callable[[], Decision] | None = None) -> Decision:
        """The leader decides through the store (``first``: round 0's decision); every rank of the
        region gets the same decision."""
        self.phases.tick("other")
        decide = first or (lambda: self.membership.decide(r, attempt, previous, self.fresh))
        d = decide() if self.layout.k == 0 else None
        self.phases.tick("members")
        if self.region_group is None:
            assert d is not None
            return d
        names = tuple(self.job)
        t = torch.zeros(4 + len(names), dtype=torch.int64)
        if d is not None:
            a, _, b = d.name.partition(".")
            t[0], t[1], t[2] = int(d.member), int(a), int(b)
            for i, g in enumerate(names):
                t[4 + i] = (3 if g in d.fresh else 1) if g in d.members else (2 if g in d.gone else 0)
        opts = BroadcastOptions()
        opts.rootRank = 0
        self.region_group.broadcast([t], opts).wait()
        members = tuple(g for i, g in enumerate(names) if t[4 + i] in (1, 3))
        gone = frozenset(g for i, g in enumerate(names) if t[4 + i] == 2)
        fresh = tuple(g for i, g in enumerate(names) if t[4 + i] == 3)
        self.phases.tick("members")
        return Decision(members, f"{int(t[1])}.{int(t[2])}", bool(t[0]), gone, fresh)

    def _member(self, r: int, attempt: int, d: Decision, current: torch.Tensor) -> tuple[int, int, str]:
        """A member's attempt: bytes sent, OK / REFUSED (a sum failed its check) / FAILED (the
        exchange raised), and why; every rank of the region ends with the same code. The step is
        staged as the waves land (``pipeline``) and committed here only when the whole region
        found every shard sound; a round with a region that rejoined steps after its hand-over."""
        sent, code, why = 0, OK, ""
        summed: dict[int, torch.Tensor] = {}
        self._pipe, self._gather = None, None
        if not d.fresh and self.sync.compression in SUMMABLE_DTYPES:  # the same on every rank of the region
            self._gather = Gather(self.layout, self.region_group, wave_count(self.layout))
        try:
            sent, summed, why = self._sum(r, attempt, d, current)
            code = REFUSED if why else OK
        except RuntimeError as e:  # a peer lost mid-round: gloo raised, or its timeout passed
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            code, why = FAILED, f"the exchange failed: {first}"
        self.phases.tick("other")
        staged = self._finish_gather()
        if code == OK and self._gather is not None and not staged:
            code, why = FAILED, "the region's gather of the staged step failed"
        self.phases.tick("gather")
        worst = region_max(self.region_group, code)
        self.phases.tick("region_agree")
        if worst == FAILED:
            self.cache.keep(lambda key: False)  # its groups may hold a dead peer: the next attempt makes new ones
            if self.layout.k == 0:
                self.membership.mark_failed(r, attempt)
            return sent, FAILED, why or "another rank of the region lost a peer"
        if worst == REFUSED:
            return sent, REFUSED, why or "another rank of the region refused a shard's sum"
        if staged and self._pipe is not None:
            pipe = self._pipe
            assert pipe.staged_p is not None and self._gather is not None
            self.opt.reset(pipe.staged_p, pipe.staged_m if self.sync.outer_momentum > 0 else None)
            self._full = self._gather.full
        else:
            m = len(d.members) - len(d.fresh)  # a region that rejoined contributed nothing
            self.opt.step(torch.cat([summed[s].float() / m for s in self.layout.mine]))
        self.phases.tick("step")
        return sent, OK, ""

    def _finish_gather(self) -> bool:
        """The attempt's staged gather posted to its end and waited for: True when the staged step
        is whole and every rank of the region holds its parameters."""
        if self._gather is None:
            return False
        pipe = self._pipe
        landed = pipe.landed_waves if pipe is not None and pipe.gather is self._gather else 0
        return self._gather.finish(landed)

    def _sum(self, r: int, attempt: int, d: Decision, current: torch.Tensor) -> tuple[int, dict[int, torch.Tensor], str]:
        """Every owned shard summed over the members and checked: bytes sent, the sums, why not ('')."""
        ring = Ring(tuple((g, self.job[g]) for g in restrict(self.ring, d.members)), f"m{d.name}")
        self.cache.keep(lambda key: isinstance(key, tuple) and key[0] == ring.name)
        timeout = self.sync.round_timeout_s
        groups = ShardGroups(
            self.store, self.kv.key("pg"), self.layout, ring, self.region, self.sync.streams, self.bind, timeout, self.cache
        )
        if self.quantized is not None:  # int8 / fp8: reduce-scatter and all-gather in the codec's bytes
            sent, summed, why = round_sum(self, groups, ring, r, attempt, d, current)
            if d.fresh:
                sent += self._hand_over(groups, ring, d, self.kv.key("r", r, attempt, "state", d.name))
                self.phases.tick("hand_over")
            return sent, summed, why
        dtype = SUMMABLE_DTYPES[self.sync.compression]
        self.phases.tick("other")
        make_groups(groups, self.layout.mine)
        self.phases.tick("groups")
        values: dict[int, torch.Tensor] = {}
        outer = self._pieces(self.opt.params)
        for s in self.layout.mine:
            a, b = self.layout.span(s)
            values[s] = (outer[s] - current[a:b]).to(dtype)
            if self.region in d.fresh:
                values[s].zero_()  # its outer shards are not the job's: it takes theirs below
        # The projections are of what this rank contributes: a copy, since the sum lands in place.
        # They are computed and published while the chunks travel (gloo's threads), off the critical path.
        contributed = {s: t.clone() for s, t in values.items()}
        if self.corrupt is not None:
            for s in self.layout.mine:
                self.corrupt(r, s, values[s])
        self.phases.tick("prepare")
        works, spans, sent = start_waves(groups, values)
        self._publish(r, attempt, d.name, contributed)
        # after the publish: the check's projectors take the codes it kept
        self._pipe = pipe = Pipeline(self.layout, self.kv.signer, f"{r}/{attempt}/{d.name}", values, spans)
        if self._gather is not None:
            pipe.stage(self._gather, self.opt.params, self.opt.momentum(), len(d.members) - len(d.fresh), self.sync)
        self.phases.tick("mac_publish")
        stop = threading.Event()
        with ThreadPoolExecutor(1, thread_name_prefix="mac-fetch") as pool:
            # the members' projections are read while the chunks travel; each chunk is projected
            # (and stepped) here as it lands, while the later ones travel
            fetched = pool.submit(self._published, r, attempt, d, stop)
            try:
                for w, wave in enumerate(works):
                    for i, work in enumerate(wave):
                        work.wait()
                        pipe.land(w, i)
                    pipe.landed(w)
            except BaseException:
                stop.set()  # a failed exchange must not wait for a lost member's projections
                raise
            self.phases.tick("transfer")
            why = self._check(r, attempt, d, values, fetched.result(), pipe.projections())
        self.phases.tick("mac_check")
        if d.fresh:
            sent += self._hand_over(groups, ring, d, self.kv.key("r", r, attempt, "state", d.name))
            self.phases.tick("hand_over")
        return sent, values, why

    def _publish(self, r: int, attempt: int, name: str, contributed: dict[int, torch.Tensor]) -> None:
        """Each owned shard's signed MAC projections of what this rank contributes."""
        tag = f"{r}/{attempt}/{name}"
        for s, t in contributed.items():
            with one_thread():  # under the wire: not the core's every thread
                projections = mac.project(self.kv.signer, tag, s, t, keep=True)  # its codes kept for the check
            self.kv.set(self.mac_key(r, attempt, name, s, self.region), mac.encode_projections(projections))

    def _hand_over(self, groups: ShardGroups, ring: Ring, d: Decision, key: str) -> int:
        """Regions that rejoined get the outer state (fp32 parameters and momentum) from the first
        member in ring order that did not, peer to peer: each owner broadcasts its shards, in the
        streams' chunks, on the shard's groups, before the step (which every member then takes
        alike), with their signed digests under ``key`` (``state_auth``). The bytes this rank sent."""
        source = next(g for g, _ in ring.members if g not in d.fresh)
        root = ring.index(source)
        mom = self.opt.momentum()
        state = {
            s: (p.clone(), torch.zeros_like(p) if mom is None else mom[i : i + p.numel()].clone())
            for s, p, i in self._owned(self.opt.params)
        }

        def pieces(s: int) -> list[torch.Tensor]:
            return [t for a, b in groups.pieces(s) for t in (state[s][0][a:b], state[s][1][a:b])]

        if self.region == source:
            for s in state:
                state_auth.publish(self.kv, f"{key}/{s}", pieces(s))
        works, sent = [], 0
        for s, (params, momentum) in state.items():
            for c, (a, b) in enumerate(groups.pieces(s)):
                opts = BroadcastOptions()
                opts.rootRank = root
                for t in (params[a:b], momentum[a:b]):
                    works.append(groups.group(s, c).broadcast([t], opts))
                    sent += (len(ring.members) - 1) * 4 * (b - a) if self.region == source else 0
        for w in works:
            w.wait()
        if self.region in d.fresh:
            why = state_auth.check_all(self.kv, [(f"{key}/{s}", pieces(s)) for s in state], self.sync.round_timeout_s)
            if region_max(self.region_group, int(bool(why))):
                why = why or OTHER_REFUSED
                raise OuterSyncError(f"DiLoCo: region {self.region} refused the outer state from {source} ({why}); start it again")
            params = torch.cat([state[s][0] for s in self.layout.mine])
            momentum = torch.cat([state[s][1] for s in self.layout.mine])
            self.opt.reset(params, momentum if self.sync.outer_momentum > 0 else None)
        return sent

    def _owned(self, own: torch.Tensor) -> list[tuple[int, torch.Tensor, int]]:
        """(shard, its part of ``own``, its offset in ``own``) for each owned shard."""
        out, i = [], 0
        for s in self.layout.mine:
            a, b = self.layout.span(s)
            out.append((s, own[i : i + b - a], i))
            i += b - a
        return out

    def mac_key(self, r: int, attempt: int, name: str, s: int, region: str) -> str:
        return self.kv.key("r", r, attempt, "mac", name, s, region)

    def _published(self, r: int, attempt: int, d: Decision, stop: threading.Event) -> dict[int, list[list[float]] | Refused | str]:
        """Each owned shard's members' signed projections; Refused, or why they did not arrive (within
        ``round_timeout_s``, or before ``stop``: waited for in short steps, so a stop ends it soon)."""
        out: dict[int, list[list[float]] | Refused | str] = {}
        deadline = time.monotonic() + self.sync.round_timeout_s
        for s in self.layout.mine:
            keys = [self.mac_key(r, attempt, d.name, s, g) for g in d.members]
            while not self.kv.wait_all(keys, max(0.001, min(FETCH_STEP_S, deadline - time.monotonic()))):
                if stop.is_set() or time.monotonic() >= deadline:
                    out[s] = f"shard {s}: the members' projections did not arrive within {self.sync.round_timeout_s:g} s"
                    break
            if s in out:
                continue
            try:
                published = []
                for key, value in zip(keys, self.kv.open_many(keys), strict=True):
                    if value is None:
                        raise Refused("unauthenticated", f"{key} is not signed by the job")
                    published.append(mac.decode_projections(value))
                out[s] = published
            except Refused as e:
                out[s] = e
        return out

    def _check(self, r: int, attempt: int, d: Decision, summed: dict[int, torch.Tensor], published: dict, got: dict) -> str:
        """Each owned shard's sum (its projections ``got``, fed wave by wave) against the members'
        signed projections (``_published``); why not, or ''."""
        for s, t in summed.items():
            pub = published[s]
            if isinstance(pub, str):
                return pub
            try:
                if isinstance(pub, Refused):
                    raise pub
                mac.check_projected(got[s], t, pub, self.sync.compression)
            except Refused as e:
                self.kv.signer.refuse(self.mac_key(r, attempt, d.name, s, self.region), e, log_it=False)
                return f"shard {s}: {e.kind}: {e.reason}"
        return ""
