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

from geoshard.trainer.diloco import mac, round0
from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.codec import codec
from geoshard.trainer.diloco.groups import Bind, CountingStore, GroupCache, gloo_group
from geoshard.trainer.diloco.handover import hand_over
from geoshard.trainer.diloco.kv import KV
from geoshard.trainer.diloco.membership import MAX_ATTEMPTS, Decision, Membership
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

    # -- one round ----------------------------------------------------------------------------------
    def run(self, r: int, step: int, current: torch.Tensor, t0: float) -> tuple[RoundRecord, torch.Tensor]:
        """Round ``r`` from this rank's current parameters (flat fp32): its record and the new full parameters."""
        carried0, refused0 = self.store.carried, self.kv.signer.total()
        self.phases = Phases()
        self._full = None
        sent, left_out, previous, adopted = 0, tuple[tuple[str, str], ...](), tuple[str, ...](), False
        for attempt in range(MAX_ATTEMPTS):
            d = self.decide(r, attempt, previous)
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
        if self.quantized is not None:
            self.quantized.end()  # no attempt of this round follows
        self.phases.tick("other")
        if self._full is not None:  # the staged step's gather ran while the waves travelled
            full, gathered = self._full, (self.layout.n - 1) * 4 * self.layout.own_numel
        else:
            full, gathered = gather_in_region(self.region_group, self.layout, self.layout.by_shard(self.opt.params))
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

    # -- round 0 (round0.py) ------------------------------------------------------------------------
    def first_round(self, source: str, current: torch.Tensor, join_timeout_s: float) -> tuple[torch.Tensor, int, int]:
        """Round 0: every region starts from ``source``'s parameters (``round0.first_round``)."""
        return round0.first_round(self, source, current, join_timeout_s)

    def decide(self, r: int, attempt: int, previous: tuple[str, ...], first: Callable[[], Decision] | None = None) -> Decision:
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
        outer = self.layout.by_shard(self.opt.params)
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
        """The rejoin hand-over (``handover.py``): the bytes this rank sent."""
        return hand_over(self, groups, ring, d, key)

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
