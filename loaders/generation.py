"""Which generation of a region a job reads: the newest every rank's region has published (agreed
with one all-gather), its manifest from the region's bucket (``manifest.json``, or the history copy
sync keeps of each generation), the local replica brought up to it, and the job's lease on it.

A bucket publishes generations one after another; a replica is only as new as its last ``pull`` or
write-back. So the bucket says which generation is newest, and a replica that is older is either
refreshed through the chain (write-back of the shards it lacks, then its manifest) or named in one
warning with the remedy. docs/guarantees.md section 11 states what this promises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geoshard.errors import DataError
from geoshard.loaders.balance import Balance
from geoshard.loaders.chain import TierChain
from geoshard.loaders.epoch import Layout
from geoshard.loaders.tier import BucketTier, TierError
from geoshard.loaders.topology import RegionShare, Topology
from geoshard.manifest import MANIFEST, RegionManifest
from geoshard.manifest.lease import Lease, history_path, lease_path

log = logging.getLogger(__name__)
LEASE_TTL_S = 3 * 86400.0  # how long a lease outlives its job's last renewal: the window to resume in


@dataclass(frozen=True)
class Pin:
    """One generation as a rank reads it: its manifest, the rank's share and the epoch layout."""

    manifest: RegionManifest
    share: RegionShare
    balance: Balance | None
    layout: Layout


class GenerationGone(DataError):
    """The generation a job pinned is no longer in its region's bucket."""


def bucket_manifest(chain: TierChain) -> RegionManifest | None:
    """The manifest the region's bucket publishes now; None without a bucket or when it cannot say."""
    return None if chain.origin is None else chain.manifest_from(chain.origin, MANIFEST, [], probe=True)


def agreed(chain: TierChain, topology: Topology | None, epoch: int | None = None) -> tuple[int | None, RegionManifest | None]:
    """The newest generation every rank's region has published (collective), and this region's
    bucket manifest read to learn it (the one to use where it is that generation). ``epoch``: the
    one being decided (None: the pin at start)."""
    probed = bucket_manifest(chain)
    return agree(topology, None if probed is None else probed.generation, epoch), probed


def agree(topology: Topology | None, newest: int | None, epoch: int | None = None) -> int | None:
    """The newest generation every rank's region has published (collective with a live topology):
    the least of the ranks' figures; a rank without a bucket has no say. Where the world does not
    span the job's regions (``topology.regions_agree``), the region leader asks the other regions
    too, and its answer is every rank's of the region."""
    live = topology is not None and topology.live and topology.world_size > 1
    seen = topology.all_gather(newest) if topology is not None and live else [newest]
    known = [int(g) for g in seen if g is not None]
    least = min(known) if known else None
    if topology is None or topology.regions_agree is None:
        return least
    mine = topology.regions_agree(least, epoch) if topology.is_leader else None
    if not live:
        return mine
    said = topology.all_gather(mine)[topology.leader]  # only the leader's value counts
    return None if said is None else int(said)


def open_generation(chain: TierChain, generation: int | None, probed: RegionManifest | None = None) -> RegionManifest:
    """The region's manifest of ``generation`` (None: what the nearest tier holds, for a region
    without a bucket): ``probed`` (the bucket's, just read) or a tier's current one if it is that
    generation, else the bucket's history copy; ``GenerationGone`` when no tier has it."""
    if generation is None:
        return chain.read_manifest()
    if probed is not None and probed.generation == generation:
        return probed
    failures: list[str] = []
    for tier in chain.tiers:
        m = chain.manifest_from(tier, MANIFEST, failures)
        if m is not None and m.generation == generation:
            return m
    if chain.origin is not None:
        m = chain.manifest_from(chain.origin, history_path(generation), failures)
        if m is not None and m.generation == generation:
            return m
    raise GenerationGone(
        f"region {chain.region}: generation {generation} is in none of its tiers (pruned from its bucket by sync --delete?): "
        + "; ".join(failures)
    )


def check_replica(chain: TierChain, manifest: RegionManifest, refresh: bool) -> None:
    """Bring an older local replica up to ``manifest``'s generation through the chain (``refresh``:
    write-back on, and this rank the region's first), or say once that it is stale."""
    replica = chain.local
    if replica is None:
        return
    old = chain.manifest_from(replica, MANIFEST, [])
    if old is None or old.generation >= manifest.generation:
        return  # an empty replica fills by write-back as it is read
    if not chain.settings.writeback:
        log.warning(
            "region %s: the local replica %s holds generation %d, its bucket generation %d: shards the replica lacks are "
            "read from the bucket; run `geoshard pull --region %s` on this node (or turn write-back on) to refresh it",
            chain.region,
            replica.name,
            old.generation,
            manifest.generation,
            chain.region,
        )
        return
    if not refresh:
        return
    fetched = 0
    for shard in manifest.shards:
        if replica.stat(shard.path) != shard.bytes:
            chain.fetch(shard)  # verified, and written back to the replica
            fetched += 1
    replica.write(MANIFEST, manifest.to_json())  # last: the replica's manifest names only shards it holds
    log.info(
        "region %s: local replica refreshed from generation %d to %d (%d shard(s) written back)",
        chain.region,
        old.generation,
        manifest.generation,
        fetched,
    )


class LeaseKeeper:
    """This job's lease in its region's bucket (written by one rank per region): the generations it
    reads, renewed when a quarter of its lifetime has passed. A bucket the loader may not write to
    is said once; the job then reads without the guarantee."""

    def __init__(self, chain: TierChain, job: str, ttl_s: float = LEASE_TTL_S, clock: Callable[[], float] = time.time) -> None:
        lease_path(job)  # a bad name is an error at once, not at the first write
        self.chain, self.job, self.ttl_s, self._clock = chain, job, ttl_s, clock
        self.generations: tuple[int, ...] = ()
        self._written = 0.0
        self._failed = False

    def hold(self, *generations: int) -> None:
        self.generations = tuple(sorted(set(generations)))
        self._write()

    def renew(self) -> None:
        if self.generations and self._clock() - self._written > self.ttl_s / 4:
            self._write()

    def _write(self) -> None:
        origin: Any = self.chain.origin
        if not isinstance(origin, BucketTier) or self._failed:
            return
        now = self._clock()
        lease = Lease(self.job, self.chain.region, self.generations, now + self.ttl_s)
        try:
            origin.put(lease_path(self.job), lease.to_json())
            self._written = now
        except TierError as e:
            self._failed = True
            log.warning(
                "region %s: cannot write the lease %s (%s): sync --delete may prune generation(s) %s while this job reads them; "
                "allow s3:PutObject on _geoshard/leases/ or keep generations with --keep-generations",
                self.chain.region,
                lease_path(self.job),
                e,
                list(self.generations),
            )
