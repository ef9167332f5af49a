"""DiLoCo inside the training loop (``--sync diloco``): the region joins the job's outer rounds after
its checkpoint is loaded, runs a round every ``--outer-steps`` steps, and its leader writes one
line per join and per round to ``RUN_DIR/rounds-<region>.jsonl`` (the report's per-round table and
each region's steps lost and rounds missed come from these files).

Steps lost are inner steps whose work never reached the outer parameters: steps a restarted region
redoes after its checkpoint, the steps since its last round when it rejoins from a newer published
state (its own parameters are replaced), the steps of a round it missed (it adopts the round's
result instead of its own), and the steps of a round that left its pseudo-gradient out (non-finite
or malformed: it takes the others' result).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from geoshard.env import read_environment
from geoshard.errors import ConfigError
from geoshard.trainer.config import TrainConfig, parse_host_port
from geoshard.trainer.context import RankContext
from geoshard.trainer.diloco.auth import Refused, read_secret
from geoshard.trainer.diloco.groups import LOOPBACK, Bind
from geoshard.trainer.diloco.kv import connect_store
from geoshard.trainer.diloco.rank import DiLoCo
from geoshard.trainer.diloco.record import RoundRecord, append, rounds_path
from geoshard.trainer.diloco.ring import ring_order
from geoshard.trainer.diloco.settings import OuterSync

log = logging.getLogger(__name__)


def outer_settings(cfg: TrainConfig) -> OuterSync:
    return OuterSync(
        outer_steps=cfg.outer_steps,
        outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum,
        nesterov=cfg.outer_nesterov,
        compression=cfg.outer_compression,
        error_feedback=cfg.outer_error_feedback,
        round_timeout_s=cfg.outer_timeout,
        join_timeout_s=max(300.0, cfg.outer_timeout),
        overlap_steps=cfg.outer_overlap,
        transport=cfg.outer_transport,
        streams=cfg.outer_streams,
    )


def p2p_placement(cfg: TrainConfig, regions: list[str]) -> tuple[Bind, tuple[str, ...]]:
    """Where this rank's exchange sockets bind (GLOO_SOCKET_IFNAME's interface, which the launcher
    sets: lo, or the region's interface under the WAN rehearsal; else 127.0.0.1), and the ring
    order (from ``--outer-wan``'s bandwidths, else the job's)."""
    ifname = read_environment().gloo_ifname
    bind = Bind(interface=ifname) if ifname else LOOPBACK
    links = None
    if cfg.outer_wan:
        from geoshard.wan.matrix import load_matrix

        matrix = load_matrix(cfg.outer_wan)
        links = {lk.pair: (lk.bytes_per_s, lk.latency_ms) for lk in matrix.links}
    return bind, ring_order(regions, links)


class OuterLoop:
    """One per rank; only the region leader talks to the store and writes the rounds file."""

    def __init__(self, cfg: TrainConfig, ctx: RankContext, model: nn.Module) -> None:
        if not cfg.outer_store or not cfg.outer_regions:
            raise ConfigError("--sync diloco needs --outer-store and --outer-regions (geoshard train --regions sets both)")
        if not cfg.outer_secret_file:
            raise ConfigError("--outer-store needs --outer-secret-file (or GEOSHARD_OUTER_SECRET_FILE): the job's secret")
        group = dist.group.WORLD if ctx.group_size > 1 else None
        self.region = ctx.region
        self.leader = ctx.group_rank == 0
        regions = [r.region for r in cfg.job_regions]
        secret = read_secret(cfg.outer_secret_file)
        sync = outer_settings(cfg)
        p2p = sync.transport == "p2p"
        if p2p:
            bind, ring = p2p_placement(cfg, regions)
            ranks = [r.nproc for r in cfg.job_regions]
            self.diloco = DiLoCo(model, sync, ctx.region, regions, group=group, secret=secret, ranks=ranks, bind=bind, ring=ring)
        else:
            self.diloco = DiLoCo(model, sync, ctx.region, regions, group=group, secret=secret)
        host, port = parse_host_port(cfg.outer_store, "--outer-store")
        # p2p: every rank meets its peers' groups through the store (their rendezvous keys)
        self.store = connect_store(host, port, timeout_s=cfg.outer_timeout) if self.leader or p2p else None
        self.path = rounds_path(cfg.out, ctx.region)
        self.job = cfg.outer_store  # one launch of the job: round numbers start again when a whole job is resumed
        self.last_round_step = 0
        if self.leader and not cfg.resume:
            self.path.unlink(missing_ok=True)  # a run started over (--overwrite); a restarted region resumes

    def join(self, step: int, resumed: dict[str, Any] | None, redone: int) -> None:
        """Collective in the region. ``resumed``: the outer part of the region's checkpoint (None: a
        fresh start); ``redone``: steps logged after that checkpoint, which the region does again."""
        if self.leader and resumed is not None and resumed.get("momentum") is not None:
            try:
                self.diloco.resume_momentum(resumed["momentum"])
            except Refused as e:  # a lost momentum costs a few rounds' speed, not the run
                log.warning("DiLoCo: region %s starts its outer momentum at zero: its checkpoint's is refused (%s)", self.region, e)
        rec = self.diloco.join(self.store)
        p2p = self.diloco.sync.transport == "p2p"  # its int8 / fp8 residual is sharded over the region's ranks
        if (self.leader or p2p) and resumed is not None and "feedback" in resumed:
            try:
                self.diloco.load_feedback(resumed["feedback"])
            except Refused as e:  # a lost residual costs one round's rounding, not the run
                log.warning("DiLoCo: region %s starts its error feedback at zero: its checkpoint's is refused (%s)", self.region, e)
        lost = redone
        if resumed is not None:
            # join() puts the newest outer parameters in place: the inner steps since the region's last
            # round, which its checkpoint held, are gone.
            lost += step - int(resumed.get("last_round_step", step))
        self.last_round_step = step
        joined = RoundRecord(rec.round, step, bytes_read=rec.bytes_read, event="join", created=rec.created, steps_lost=lost)
        joined = dataclasses.replace(joined, refused=rec.refused)
        if self.diloco.sync.transport == "p2p":  # round 0 went peer to peer: what the store carried for the join
            joined = dataclasses.replace(joined, transport="p2p", store_bytes=self.diloco.join_store_bytes)
        self._write(joined)

    def after_step(self, step: int) -> None:
        self._record(self.diloco.maybe_sync(step))

    def finish(self) -> None:
        """After the last step: the round still in flight (``--outer-overlap``), if any."""
        self._record(self.diloco.finish())

    def _record(self, rec: RoundRecord | None) -> None:
        if rec is None:
            return
        # Adopted, or its own pseudo-gradient left out: this region's steps since its last round never reached the outer parameters.
        lost = rec.step - self.last_round_step if rec.adopted or self.region in dict(rec.left_out) else 0
        self.last_round_step = rec.step
        self._write(dataclasses.replace(rec, steps_lost=lost))

    def state(self) -> dict[str, Any]:
        """Collective in the region (every rank calls it): what the region's checkpoint keeps of the
        outer loop (the leader's is the one saved; the momentum as of the last round the region took)."""
        return {
            "round": self.diloco.round - 1,
            "last_round_step": self.last_round_step,
            "feedback": self.diloco.feedback_state(),
            "momentum": self.diloco.outer_momentum(),
        }

    def leave(self) -> None:
        self.finish()
        self.diloco.leave()

    def _write(self, rec: RoundRecord) -> None:
        if self.leader:
            append(self.path, dataclasses.replace(rec, region=self.region, job=self.job))
