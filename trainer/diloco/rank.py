"""``DiLoCo``: one per rank. With the store transport the region leader (in-region rank 0) keeps
the outer optimizer and runs the exchange through the store; every rank of the region takes the
new parameters by broadcast in the region's own process group. With the peer-to-peer transport
(``OuterSync.transport == "p2p"``) every rank keeps its shards of the outer state and runs the
exchange (``p2p``) over gloo groups of its own; the store carries membership and rendezvous only."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from geoshard.errors import ConfigError
from geoshard.trainer.diloco.auth import Refused, Signer
from geoshard.trainer.diloco.checks import Bounds
from geoshard.trainer.diloco.codec import ErrorFeedback, NonFinite, codec, unusable
from geoshard.trainer.diloco.exchange import Exchange, Pending
from geoshard.trainer.diloco.groups import LOOPBACK, Bind, CountingStore
from geoshard.trainer.diloco.kv import KV, OuterSyncError, Store
from geoshard.trainer.diloco.membership import last_round
from geoshard.trainer.diloco.optimizer import OuterOptimizer, latest, wait_latest
from geoshard.trainer.diloco.p2p import Corrupt, P2PExchange
from geoshard.trainer.diloco.record import JoinRecord, RoundRecord
from geoshard.trainer.diloco.resume import checked_momentum, gathered
from geoshard.trainer.diloco.settings import OuterSync
from geoshard.trainer.diloco.tcp import congestion_advice

log = logging.getLogger(__name__)


class DiLoCo:
    """``join(store)`` first (collective in the region), then ``maybe_sync(step)`` after every inner
    optimizer step: every ``outer_steps`` steps it runs a round and returns its ``RoundRecord``.
    ``group`` is the region's own process group (``None`` for a one-rank region); ``secret`` is the
    job's (``auth``): every value in the store is signed with it, and one that is not is refused.
    With ``sync.transport == "p2p"``, every rank passes the store to ``join``, and ``ranks`` gives
    each job region's rank count (job order), ``bind`` where this rank's gloo sockets listen, and
    ``ring`` the regions' ring order (default: the job's).
    """

    def __init__(
        self,
        model: nn.Module,
        sync: OuterSync,
        region: str,
        regions: Sequence[str],
        group: Any = None,
        prefix: str = "diloco",
        *,
        secret: bytes,
        ranks: Sequence[int] | None = None,
        bind: Bind = LOOPBACK,
        ring: Sequence[str] | None = None,
        corrupt: Corrupt | None = None,
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
        self._signer = Signer(secret)
        self._opt = OuterOptimizer(sync, Bounds(sum(p.numel() for p in self.params), sync.compression))
        # The leader's residual of what the codec dropped (codec.py); its state goes into the region's checkpoint.
        self.feedback = ErrorFeedback(codec(sync.compression), self._opt.bounds.numel, sync.error_feedback)
        self._exchange: Exchange | None = None  # the leader's, from join on
        self._pending: Pending | None = None  # the round in flight (overlap_steps > 0)
        self._step = 0  # the last inner step maybe_sync saw
        self._p2p: P2PExchange | None = None  # every rank's, from join on (transport p2p)
        self._rejoined = False  # p2p: the leader joined a job that had rounds: the state comes in the next round
        self._first = False  # p2p: the leader joined before round 0: the first region's parameters come in join
        self.join_store_bytes = 0  # p2p: the bytes this rank's store client carried for join (round 0 included)
        self._resumed_momentum: torch.Tensor | None = None  # the leader's, from its checkpoint (resume.py)
        self._p2p_args = (tuple(ranks or ()), bind, tuple(ring or regions), corrupt)
        if sync.transport == "p2p" and len(self._p2p_args[0]) != len(self.regions):
            raise ConfigError(f"DiLoCo p2p: give the rank count of each of the job's {len(self.regions)} regions (ranks=...)")

    @property
    def outer(self) -> torch.Tensor:
        """The outer parameters (flat fp32), on the leader."""
        return self._opt.params

    def _leader(self) -> Exchange:
        if self._exchange is None:
            raise OuterSyncError("DiLoCo: call join(store) before the first round")
        return self._exchange

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

    def _check_contract(self, kv: KV) -> None:
        value = kv.get(kv.key("config"))
        if value is None:  # refused (counted): the outer state's own checks still hold
            return
        try:
            theirs = json.loads(value)
        except ValueError:
            theirs = None
        if not isinstance(theirs, dict):
            kv.signer.refuse(kv.key("config"), Refused("malformed", "not a JSON object"), value)
            return
        ours = self._contract()
        diff = [f"{k} {ours[k]} (the job has {theirs.get(k)})" for k in ours if theirs.get(k) != ours[k]]
        if diff:
            raise ConfigError(f"DiLoCo: region {self.region} does not match the job's outer settings: {'; '.join(diff)}")

    def join(self, store: Store | None) -> JoinRecord:
        """Start from the newest published outer state (a region restarting: live recovery), or, in a
        fresh job, the first region publishes its own parameters as round 0 and the others take them."""
        rec: JoinRecord | None = None
        p2p = self.sync.transport == "p2p"
        if p2p and store is not None:
            store = CountingStore(store)
        if (self.is_leader or p2p) and store is None:
            raise ConfigError("DiLoCo.join: the region leader (every rank with transport p2p) needs the outer store")
        if self.is_leader:
            assert store is not None
            rec = self._join_store(store)
            log.info("DiLoCo: region %s starts from outer round %d (step %d)", self.region, rec.round, rec.step)
        rec = self._in_region(rec)
        assert rec is not None
        self.round = rec.round + 1
        if p2p:
            assert isinstance(store, CountingStore)
            got, start = self._join_p2p(store)
            rec = dataclasses.replace(rec, bytes_read=got, round=max(rec.round, start))
            self.round = rec.round + 1
            self.join_store_bytes = store.carried
        return rec

    def _join_p2p(self, store: CountingStore) -> tuple[int, int]:
        """Every rank: its shards of the outer state (parameters in place since ``join``; momentum
        from the leader) and its exchange, whose region group meets under a token of this join;
        before round 0, round 0 itself (the first region's parameters, peer to peer). The bytes
        this rank received across regions, and the round the region starts from."""
        ranks, bind, ring, corrupt = self._p2p_args
        flat = self._flat()
        mom = self._opt.momentum() if self.is_leader and self._opt.momentum() is not None else None
        token = time.time_ns() if self.is_leader else 0
        box = [(token, mom is not None, self._rejoined, self._first)]
        if self.group is not None:
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        token, has_mom, rejoined, first = box[0]
        if has_mom:
            mom = mom if self.is_leader else torch.empty_like(flat)
            assert mom is not None
            if self.group is not None:
                dist.broadcast(mom, group=self.group, group_src=0)
        rank = 0 if self.group is None else dist.get_rank(self.group)
        if self.is_leader and (advice := congestion_advice()) is not None:
            log.warning("DiLoCo: region %s: %s", self.region, advice)
        kv = KV(store, self.prefix, self._signer)
        opt = OuterOptimizer(self.sync, self._opt.bounds)
        job = tuple(zip(self.regions, ranks, strict=True))
        self._p2p = P2PExchange(store, kv, self.sync, self.region, job, ring, rank, bind, flat.numel(), opt, str(token), corrupt)
        opt.reset(self._p2p.own(flat), None if mom is None else self._p2p.own(mom))
        self._p2p.fresh = rejoined
        if not first:
            return 0, 0
        full, got, start = self._p2p.first_round(self.regions[0], flat, self.sync.join_timeout_s)
        self._load_flat(full)
        if self.is_leader:  # the leader's whole outer parameters, as the store transport's leader has them
            self._opt.reset(full, None)
        return got, start

    def _join_store(self, store: Store) -> JoinRecord:
        """The leader's part of ``join``."""
        self.store = store
        kv = KV(store, self.prefix, self._signer)
        ex = self._exchange = Exchange(kv, self.sync, self.region, self.regions, self._opt, self.params[0].device)
        if self.sync.transport == "p2p" and (last := last_round(kv)) > 0:
            # Rounds went on peer to peer since round 0: the state comes from a live region's owners in
            # this region's first round (``P2PExchange.fresh``), never through the store.
            self._check_contract(kv)
            self._opt.reset(self._flat(), None)
            self._rejoined = True
            ex.roster.announce(self.region, last + 1)
            return JoinRecord(last, 0, False, 0, refused=ex.refused())
        if self.sync.transport == "p2p":
            return self._join_first_p2p(store, kv, ex)
        newest = latest(kv)
        if newest is None and self.region == self.regions[0] and store.add(kv.key("created"), 1) == 1:
            self._opt.reset(self._flat(), self._resumed_momentum)
            kv.set(kv.key("config"), json.dumps(self._contract()))
            ex.roster.start()
            self._opt.publish(kv, 0, 0)
            rec = JoinRecord(0, 0, True, 0)
        else:
            if newest is None:
                newest = wait_latest(kv, 0, self.sync.join_timeout_s)
            self._check_contract(kv)
            got = self._opt.adopt_latest(kv, newest, self.params[0].device)
            if isinstance(got, Refused):
                self._opt.reset(self._flat(), None)
                log.warning(
                    "DiLoCo: region %s refused the published outer state of round %d (%s: %s); it keeps its own parameters",
                    self.region,
                    newest,
                    got.kind,
                    got.reason,
                )
                rec = JoinRecord(newest, 0, False, 0)
            else:
                rec = JoinRecord(*got[:2], False, got[2])
        self._load_flat(self.outer)
        # The others wait for this region from the round after the one it starts from.
        ex.roster.announce(self.region, rec.round + 1)
        return dataclasses.replace(rec, refused=ex.refused())

    def _join_first_p2p(self, store: Store, kv: KV, ex: Exchange) -> JoinRecord:
        """The leader's part of a p2p join before any round: the job's first region creates the job
        (its settings, the roster); the others check its settings. Its parameters (its own, or its
        checkpoint's when the whole job is resumed) reach them in round 0 peer to peer
        (``P2PExchange.first_round``), never through the store."""
        created = self.region == self.regions[0] and store.add(kv.key("created"), 1) == 1
        if created:
            kv.set(kv.key("config"), json.dumps(self._contract()))
            ex.roster.start()
        elif not kv.wait_all([kv.key("config")], self.sync.join_timeout_s):
            raise OuterSyncError(
                f"DiLoCo: region {self.region} found no job in the store within {self.sync.join_timeout_s:g} s "
                f"(key {kv.key('config')}, which {self.regions[0]} sets when it starts)"
            )
        else:
            self._check_contract(kv)
        self._opt.reset(self._flat(), self._resumed_momentum)  # round 0 hands the first region's to every region
        self._first = True
        return JoinRecord(0, 0, created, 0, refused=ex.refused())

    # -- error feedback state -------------------------------------------------------------------
    def feedback_state(self) -> dict[str, Any]:
        """The residual for the region's checkpoint. With p2p and int8 / fp8 each rank holds its
        owned shards' residual: summed over the region (each shard has one owner), so collective
        in the region: call it on every rank. Otherwise the leader's ``ErrorFeedback``."""
        q = None if self._p2p is None else self._p2p.quantized
        if q is None or self._p2p is None:
            return self.feedback.state_dict()
        if not self.feedback.enabled:
            return {"codec": q.codec.name, "residual": None}
        layout = self._p2p.layout
        full = q.state({s: layout.span(s) for s in layout.mine}, layout.numel).to(self.params[0].device)  # nccl: on the device
        if self.group is not None:
            dist.all_reduce(full, group=self.group)
        return {"codec": q.codec.name, "residual": full.cpu()}

    def load_feedback(self, state: Any) -> None:
        """A checkpoint's residual, checked (``Refused``: nothing changes); with p2p and int8 / fp8
        every rank takes its owned shards of it."""
        q = None if self._p2p is None else self._p2p.quantized
        if q is None or self._p2p is None:
            self.feedback.load_state_dict(state)
            return
        checked = ErrorFeedback(q.codec, self._p2p.layout.numel, self.feedback.enabled)
        checked.load_state_dict(state)
        layout = self._p2p.layout
        q.load(checked, {s: layout.span(s) for s in layout.mine})

    # -- the outer round ------------------------------------------------------------------------
    def _encode(self, delta: torch.Tensor) -> bytes:
        """The leader's pseudo-gradient as published (with error feedback). One that is not finite
        goes out as a value every leader refuses as non-finite, so the round leaves it out at once."""
        try:
            return self.feedback.encode(delta)
        except NonFinite as e:
            log.warning("DiLoCo: region %s publishes an unusable pseudo-gradient for round %d: %s", self.region, self.round, e)
            return unusable(self.feedback.codec, delta.numel())

    # -- the outer momentum in checkpoints (resume.py) ------------------------------------------
    def resume_momentum(self, value: Any) -> None:
        """The leader, before ``join``: its checkpoint's outer momentum, checked (Refused: it starts
        from zero). The job's first region's goes to every region in round 0."""
        self._resumed_momentum = checked_momentum(value, self._opt.bounds.numel)

    def outer_momentum(self) -> torch.Tensor | None:
        """Collective in the region: the outer momentum as of the last round the region took (a
        round in flight is not in it), whole, on the leader; None on the others, or before the
        first outer step."""
        if self._pending is not None:
            held = self._pending.kept_momentum()  # the round's thread made it a copy
        elif self._p2p is not None:
            held = self._p2p.opt.momentum()  # no round runs: read in place (the leader's gather copies it)
        else:
            mom = self._opt.momentum() if self.is_leader else None
            return None if mom is None else mom.clone()
        if self._p2p is None:
            return held if self.is_leader else None
        return gathered(held, self._p2p.layout, self.group, self.params[0].device)  # to the leader only

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
        if self._p2p is not None:
            done, full = self._p2p.run(self.round, step, self._flat(), t0)
            self._load_flat(full)
            self.round = done.round + 1
            return dataclasses.replace(done, exchange_s=done.sync_s, applied_step=step)
        rec: RoundRecord | None = None
        if self.is_leader:
            payload = self._encode(self.outer - self._flat())
            rec = self._leader().run(self.round, step, payload, t0)
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
        pending = Pending(step, step + self.sync.overlap_steps)
        if self._p2p is not None:
            # Every rank runs the exchange in a thread, on its own groups; training never touches them.
            pending.snapshot = self._flat()
            p2p, r, snap = self._p2p, self.round, pending.snapshot

            def work() -> RoundRecord:
                pending.keep_momentum(p2p.opt.momentum())
                rec, pending.params = p2p.run(r, step, snap, time.perf_counter())
                return rec

            pending.run_behind(work, f"diloco-round-{r}")
        elif self.is_leader:
            pending.snapshot = self._flat()
            payload = self._encode(self.outer - pending.snapshot)
            ex, r = self._leader(), self.round
            # Only this thread uses the store and the outer tensors until finish(); the training
            # thread touches the model's parameters only.
            mom = self._opt.momentum()

            def leader_work() -> RoundRecord:
                pending.keep_momentum(mom)
                return ex.run(r, step, payload, time.perf_counter())

            pending.run_behind(leader_work, f"diloco-round-{r}")
        pending.blocked_s = time.perf_counter() - t0
        self._pending = pending

    def finish(self) -> RoundRecord | None:
        """Collective in the region: take the round in flight, if any (the trainer calls it after the
        last step too). New parameters: the round's outer ones plus the steps since it started."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        t0 = time.perf_counter()
        if self._p2p is not None:
            done = pending.result()
            assert pending.params is not None and pending.snapshot is not None
            self._load_flat(pending.params + (self._flat() - pending.snapshot))
            self.round = done.round + 1
            waited = pending.blocked_s + time.perf_counter() - t0
            return dataclasses.replace(done, exchange_s=done.sync_s, sync_s=waited, applied_step=self._step)
        rec: RoundRecord | None = None
        params = None
        if self.is_leader:
            done = pending.result()
            assert pending.snapshot is not None
            params = self.outer + (self._flat() - pending.snapshot)
            self._load_flat(params)
            rec = dataclasses.replace(done, exchange_s=done.sync_s)
        rec = self._in_region(rec, params)
        assert rec is not None
        self.round = rec.round + 1
        waited = pending.blocked_s + time.perf_counter() - t0
        return dataclasses.replace(rec, sync_s=waited, applied_step=self._step)

    def leave(self) -> None:
        """The region finished its steps: the others stop waiting for it from their next round on."""
        if self.is_leader and self._p2p is not None:
            self._p2p.membership.roster.leave(self.region)
        elif self.is_leader and self._exchange is not None:
            self._exchange.roster.leave(self.region)
