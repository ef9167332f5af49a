"""The dataset's generations: which one each epoch reads, moving at epoch boundaries with
``follow_refresh``, and going back to a checkpoint's while its bucket holds it.

A part of :class:`~geoshard.loaders.dataset.RegionalDataset` kept apart by job: it reads and sets
the dataset's manifest, share, balance and layout, which describe the generation being read.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from geoshard.errors import ConfigError
from geoshard.loaders import generation as gen
from geoshard.loaders.generation import GenerationGone, LeaseKeeper, Pin
from geoshard.loaders.share import find_share
from geoshard.manifest import RegionManifest

if TYPE_CHECKING:
    from geoshard.loaders.balance import Balance
    from geoshard.loaders.chain import TierChain
    from geoshard.loaders.epoch import Layout
    from geoshard.loaders.topology import RegionShare, Topology

log = logging.getLogger(__name__)


class FollowsGenerations:
    generations: dict[int, int]  # epoch -> the generation it read (the report's)
    _next: tuple[int, Pin] | None  # a generation the loader moves to from that epoch on (follow_refresh)
    lease: LeaseKeeper | None  # the job's lease, held by the region's first rank
    # The dataset's, read and set here.
    region: str
    manifest: RegionManifest
    share: RegionShare
    balance: Balance
    layout: Layout
    follow_refresh: bool
    _topology: Topology | None
    _share_args: tuple[Any, ...]
    _counts: list[int]

    if TYPE_CHECKING:

        def chain(self) -> TierChain: ...

    def _hold(self, lease: str | None, check: bool) -> None:
        """The generation opened: the replica brought to it (``check``), the job's ``lease`` on it."""
        if check:
            gen.check_replica(self.chain(), self.manifest, refresh=self.share.rank == 0)
        self.generations = {}
        self._next = None
        self.lease = LeaseKeeper(self.chain(), lease) if lease and self.share.rank == 0 else None
        if self.lease is not None:
            self.lease.hold(self.manifest.generation)

    def _move_to(self, epoch: int) -> None:
        """At ``set_epoch``: the generation ``follow`` decided on takes over from its epoch on."""
        if self._next is not None and epoch >= self._next[0]:
            self._apply(self._next[1])
            self._next = None

    def follow(self, epoch: int) -> None:
        """With ``follow_refresh``, decide (collective: every rank calls it at the same point) whether
        ``epoch`` moves to a newer generation: the newest every rank's region has published."""
        if not self.follow_refresh or (self._next is not None and self._next[0] == epoch):
            return
        newest, probed = gen.agreed(self.chain(), self._topology, epoch)
        if newest is None or newest <= self.manifest.generation:
            return
        pin = self._pin(newest, probed)
        self._next = (epoch, pin)
        if self.lease is not None:
            self.lease.hold(self.manifest.generation, newest)  # both, until this epoch ends
        log.info("region %s: epoch %d reads generation %d (was %d)", self.region, epoch, newest, self.manifest.generation)

    def _pin(self, generation: int, probed: RegionManifest | None = None) -> Pin:
        """This rank's arithmetic on ``generation`` (collective where the job's balance is agreed)."""
        m = gen.open_generation(self.chain(), generation, probed)
        share, found = find_share(self.region, m.samples, self._topology, *self._share_args)
        gen.check_replica(self.chain(), m, refresh=share.rank == 0)
        return Pin(m, share, found, dataclasses.replace(self.layout, samples_per_rank=share.samples_per_rank))

    def _apply(self, pin: Pin) -> None:
        self.manifest, self.share, self.balance, self.layout = pin.manifest, pin.share, pin.balance, pin.layout
        self._counts = pin.manifest.table.column("samples").tolist()
        if self.lease is not None:
            self.lease.hold(pin.manifest.generation)

    def _at(self, epoch: int) -> Pin:
        """What ``epoch`` reads: the pending generation from its epoch on, else the current one."""
        if self._next is not None and epoch >= self._next[0]:
            return self._next[1]
        return Pin(self.manifest, self.share, self.balance, self.layout)

    def _resume_generation(self, generation: int, epoch: int) -> bool:
        """Go back to a checkpoint's ``generation`` while it is readable (True). Where it is gone:
        with ``follow_refresh``, epoch ``epoch + 1`` starts on this generation (False); without, a
        one-line error saying what to do."""
        try:
            self._apply(self._pin(generation))
            return True
        except GenerationGone as e:
            now = self.manifest.generation
            if not self.follow_refresh:
                raise ConfigError(
                    f"region {self.region}: the checkpoint read generation {generation}, which is gone from its bucket; resume with "
                    f"--follow-refresh (follow_refresh=True) to start epoch {epoch + 1} on generation {now}, and keep what a job "
                    "reads with a lease (docs/guarantees.md section 11)"
                ) from e
            said = "region %s: the checkpoint read generation %d, which is gone from its bucket: the rest of epoch %d is skipped, "
            log.warning(said + "epoch %d starts on generation %d", self.region, generation, epoch, epoch + 1, now)
            return False
