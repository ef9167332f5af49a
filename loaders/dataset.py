"""``RegionalDataset``: a PyTorch ``IterableDataset`` over one region's shards, read through the
tier chain (Alluxio, local replica, the region's bucket, other regions' buckets).

The epoch's order is computed from the manifest alone (``epoch.py``), so each rank and DataLoader
worker knows which shards it needs before reading any: they are prefetched in that order, and a
resumed run skips what was consumed without reading it again. Where the manifest has chunk hashes
a worker fetches pieces of shards (``pieces.py``), the rank's workers taking turns on the link in
the order its batches need them (``fetchqueue.py``): the first batch waits for its own chunks, not
for whole shards. The chain (S3 clients, Alluxio sessions, thread pools) is built lazily in the
process that iterates, never pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from geoshard.env import read_environment
from geoshard.errors import ConfigError, GeoshardError
from geoshard.loaders import generation as gen
from geoshard.loaders.balance import Remainder
from geoshard.loaders.batching import StatsShipper, item_count, make_items
from geoshard.loaders.chain import ChainSettings, TierChain, build_chain
from geoshard.loaders.decode import DecodeSpec, collate, make_decoder, tensor_spec
from geoshard.loaders.egress import EgressCounter
from geoshard.loaders.elastic import epoch_per, own_state, resume_point
from geoshard.loaders.epoch import Layout, per_rank
from geoshard.loaders.fetchqueue import FetchQueue
from geoshard.loaders.following import FollowsGenerations
from geoshard.loaders.handoff import Consumption, EpochStart, WorkerFailure
from geoshard.loaders.pieces import ChunkMap, RankPieces, rank_pieces
from geoshard.loaders.reader import PieceFetcher, WorkerReader
from geoshard.loaders.share import find_share, resolve_region
from geoshard.loaders.sharedepoch import SharedEpoch
from geoshard.loaders.stats import LoaderStats
from geoshard.loaders.topology import Topology
from geoshard.manifest import RegionManifest
from geoshard.plan import Plan, load_plan

log = logging.getLogger(__name__)
# 2: keyed by region and rank within the region; 3: shuffle windows grow from one batch (epoch.py),
# so a position saved under 2 would point into another order: refused, not resumed wrongly.
STATE_VERSION = 3


class RegionalDataset(FollowsGenerations, IterableDataset[Any]):
    """Samples of one region, split across ranks and DataLoader workers with equal counts per rank.

    ``RegionalDataset(plan, region="eu-west-1", shuffle=False, seed=0)`` yields, for WebDataset,
    ``{"__key__": str, field: bytes, ...}`` and for TFRecord the record bytes (or, with
    ``decode="example"``, the parsed ``tf.train.Example`` as a dict of numpy arrays).
    With ``batch_size``, items are batches made by ``collate_fn`` inside the worker (what
    ``make_loader`` uses: one pickled object per batch instead of one per sample).
    ``copy=False`` yields fields as read-only memoryviews of the mapped shard instead of ``bytes``
    (see ``shard.py`` for their lifetime). ``decode=TensorSpec(...)`` (with ``batch_size``) makes
    each batch a dict of tensors, decoded straight into one buffer (``decode.fill_batch``).

    Who reads what: a region's samples go to that region's ranks only. ``topology=`` (a
    ``Topology``, e.g. ``Topology.discover(region)`` inside the job) gives the rank's region, its
    rank within the region and the region's rank count, and agrees the job-wide samples per rank
    with the other ranks (collective: every rank builds its dataset). Without a live topology,
    ``region_rank=``, ``region_size=`` and ``samples_per_rank=`` say the same (``rank=`` and
    ``world_size=`` are their older names). With none of them, under torch.distributed, a
    single-region job uses the global rank and world size; a job whose ranks span regions is a
    ``ConfigError`` saying what to pass.
    """

    def __init__(
        self,
        plan: Plan | str | os.PathLike[str],
        region: str | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        prefetch: int = 2,
        decode: DecodeSpec = None,
        topology: Topology | None = None,
        region_rank: int | None = None,
        region_size: int | None = None,
        samples_per_rank: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        remainder: Remainder = "drop",
        batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        settings: ChainSettings | None = None,
        allow_cross_region: bool | None = None,
        manifest: RegionManifest | None = None,
        environ: Mapping[str, str] | None = None,
        copy: bool = True,
        follow_refresh: bool = False,
        lease: str | None = None,
    ) -> None:
        super().__init__()
        _check_sizes(prefetch, batch_size)
        self.plan = plan if isinstance(plan, Plan) else load_plan(Path(plan))
        self.region = _own_region(region, topology, environ)
        self.plan.region(self.region)  # unknown region: a ConfigError naming the plan's regions
        self.prefetch = prefetch
        self.settings = settings or ChainSettings()
        if allow_cross_region is not None:
            self.settings = dataclasses.replace(self.settings, allow_cross_region=allow_cross_region)
        self._epoch = SharedEpoch()  # read by DataLoader workers at each iteration's start (persistent ones too)
        self._chain: TierChain | None = None
        self._inherited_cooldowns: dict[str, float] = {}
        # The rank's cross-region bytes, shared with the workers it forks: one budget for them all.
        self.egress = EgressCounter()
        # The generation this job reads: the newest every rank's region has published (collective).
        self.follow_refresh = follow_refresh
        self._topology = topology
        self.manifest = manifest or gen.open_generation(self.chain(), *gen.agreed(self.chain(), topology))
        self.decoder = make_decoder(decode, self.manifest.format)
        self.tensors = tensor_spec(decode, self.manifest.format, batch_size)
        self.copy = copy and self.tensors is None  # a TensorSpec copies each field once, into its batch
        self._counts = self.manifest.table.column("samples").tolist()
        rank = region_rank if region_rank is not None else rank
        size = region_size if region_size is not None else world_size
        self._share_args = (rank, size, samples_per_rank, remainder)
        self.share, self.balance = find_share(self.region, sum(self._counts), topology, rank, size, samples_per_rank, remainder)
        self._hold(lease, check=manifest is None)
        self.layout = Layout(
            rank=self.share.rank,
            world_size=self.share.size,
            batch_size=batch_size or 1,
            seed=seed,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            remainder=remainder,
            samples_per_rank=self.share.samples_per_rank,
        )
        self.batched = batch_size is not None
        self.collate_fn = collate_fn or collate
        self.consumption = Consumption()  # the consumer's progress in the current epoch, per logical worker
        # The start RegionalLoader hands to the workers it forks (handing_over); None: a plain iteration.
        self.handed_over: EpochStart | None = None

    # -- process-local state ------------------------------------------------------------
    def chain(self) -> TierChain:
        if self._chain is None:
            self._chain = build_chain(self.plan, self.region, self.settings, LoaderStats(), egress=self.egress)
            self._chain.note_cooldowns(self._inherited_cooldowns)
        return self._chain

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chain"] = None  # clients and sessions are per process; what failed is not
        state["_inherited_cooldowns"] = self._chain.cooldowns() if self._chain is not None else {}
        state["_topology"] = state["lease"] = None  # process groups and the lease stay with the rank
        return state

    # -- epochs, length, state ----------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch.value

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._epoch.value = epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._move_to(epoch)

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank yields per epoch (the same on every rank)."""
        return self._per_rank()

    def _per_rank(self) -> int:
        return per_rank(sum(self._counts), self.layout)

    @property
    def rank(self) -> int:
        """This rank's place in its region."""
        return self.share.rank

    @property
    def world_size(self) -> int:
        """Ranks in this region (the job's ranks in a single-region job)."""
        return self.share.size

    @property
    def _item_size(self) -> int:
        """Samples per yielded item: 0 when items are samples, else the batch size."""
        return self.layout.batch_size if self.batched else 0

    def __len__(self) -> int:
        """Items (samples, or batches with ``batch_size``) this rank yields per epoch."""
        return item_count(self._per_rank(), self._item_size)

    def items_left(self) -> int:
        """Items of the current epoch not yet handed to the consumer (an epoch resumed on another
        world has its own length: ``elastic.py``)."""
        per = epoch_per(self._counts, self.epoch, self.layout, self.consumption.segments)
        return item_count(per, self._item_size) - self.items_taken()

    def remainder(self) -> dict[str, int]:
        """Per epoch, over this region's ranks: samples left out, and samples read twice."""
        total = sum(self._counts)
        read = self._per_rank() * self.world_size
        return {"dropped_samples": max(0, total - read), "padded_samples": max(0, read - total)}

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the epoch: enough for ``load_state_dict`` to continue exactly."""
        return {
            "version": STATE_VERSION,
            "region": self.region,
            "generation": self.manifest.generation,
            "epoch": self.epoch,
            "seed": self.layout.seed,
            "shuffle": self.layout.shuffle,
            "region_rank": self.rank,
            "region_size": self.world_size,
            "samples_per_rank": epoch_per(self._counts, self.epoch, self.layout, self.consumption.segments),
            "batch_size": self.layout.batch_size,
            "shuffle_buffer": self.layout.shuffle_buffer,
            "num_workers": len(self.consumption.consumed),
            "consumed": list(self.consumption.consumed),
            "next_worker": self.consumption.next_worker,
            "segments": [s.to_json() for s in self.consumption.segments],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from this rank's ``state_dict()``, exactly; or from ``region_states(...)`` (every
        saved rank of the region), which also resumes on another rank count (``elastic.py``)."""
        saved = own_state(state, self.rank)
        pinned = saved.get("generation") if saved is not None else None
        if isinstance(pinned, int) and pinned != self.manifest.generation and not self._resume_generation(pinned, int(state["epoch"])):
            self.epoch = int(state["epoch"]) + 1  # its generation is gone: the next epoch on this one
            return
        if saved is not None:
            self._check(saved)
        point = resume_point(state, self._counts, self.layout)
        if point.note and self.rank == 0:
            log.warning("%s: %s", self.region, point.note)
        self.epoch = point.epoch
        self.consumption.restore(point.consumed, point.next_worker, point.segments)

    def _check(self, state: Mapping[str, Any]) -> None:
        """Refuse a saved state that no rank count makes fit this loader."""
        mine = self.state_dict()
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"loader state version {state.get('version')!r} is not {STATE_VERSION}: it was saved by another geoshard, "
                "whose epoch order differs; restart the epoch (drop the loader state) or resume with that version"
            )
        # shuffle_buffer: states saved before elastic resume lack it (their resume is the same-world one).
        for k in ("region", "generation", "seed", "shuffle", "batch_size", "shuffle_buffer"):
            if state.get(k, mine[k] if k == "shuffle_buffer" else None) != mine[k]:
                raise ConfigError(f"loader state does not fit this loader: {k} is {state.get(k)!r} there, {mine[k]!r} here")

    def begin(self, num_workers: int, *, tagged: bool = False) -> EpochStart:
        """Begin an iteration of the current epoch: its start, from a loaded state or from zero."""
        self.generations[self.epoch] = self.manifest.generation
        if self.lease is not None:
            self.lease.renew()
        return self.consumption.begin(self.epoch, num_workers, tagged)

    @contextlib.contextmanager
    def handing_over(self, start: EpochStart) -> Iterator[None]:
        """Within this block, iterations (and the DataLoader workers forked in it) begin at ``start``."""
        self.handed_over = start
        try:
            yield
        finally:
            self.handed_over = None

    def items_taken(self) -> int:
        """Items (samples, or batches) of the current epoch handed to the consumer so far."""
        return self.consumption.items(self._item_size or 1)

    def record(self, worker: int, samples: int) -> None:
        """Count samples handed to the consumer (the loader calls this for its workers' items)."""
        self.consumption.record(worker, samples)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        start = self.handed_over
        if info is None:  # the main process: one logical worker, counted here
            return self._generate(0, start or self.begin(1), count=True)
        # A DataLoader worker, forked inside handing_over() (or by a plain DataLoader: no resume).
        if self._chain is not None:
            # Forked with the training process's chain: its pooled connections are shared with the
            # parent and the sibling workers (responses would cross). Build our own, keep what failed.
            self._inherited_cooldowns = self._chain.cooldowns()
            self._chain = None
        if start is None or start.num_workers != info.num_workers:
            start = EpochStart.fresh(self.epoch, info.num_workers)
        return self._generate((info.id + start.rotation) % info.num_workers, start, count=False)

    def rank_pieces(self, start: EpochStart) -> RankPieces:
        """Per logical worker of this rank: its pieces (after its skip), their places in the rank's
        fetch order, and its stream (shards, indices). The same in every process of the rank."""
        pin = self._at(start.epoch)
        layout = dataclasses.replace(pin.layout, num_workers=start.num_workers)
        cmap = ChunkMap(pin.manifest.shards, self.chain().reads_chunks, self.chain().with_chunks)
        counts = pin.manifest.table.column("samples").tolist()
        return rank_pieces(counts, cmap, layout, start.epoch, start.skips, start.rotation, start.segments)

    def fetch_queue(self, start: EpochStart) -> FetchQueue:
        """The rank's fetch order for an iteration beginning at ``start`` (made before the workers fork)."""
        rp = self.rank_pieces(start)
        return FetchQueue(rp.sizes(), free=rp.first_round(self.layout.batch_size))

    def _reader(self, worker: int, start: EpochStart) -> WorkerReader:
        rp = self.rank_pieces(start)
        fq = start.fetch_queue
        if not (isinstance(fq, FetchQueue) and fq.size == sum(map(len, rp.places))):
            fq = None  # not this iteration's layout (or no queue): pieces go at once
        mine = rp.workers[worker]
        fetcher = PieceFetcher(self.chain(), self._at(start.epoch).manifest, mine.pieces, rp.places[worker], fq, self.copy)
        return WorkerReader(fetcher, mine, rp.streams[worker], self.prefetch, self.decoder)

    def _generate(self, worker: int, start: EpochStart, count: bool) -> Iterator[Any]:
        """Logical ``worker``'s items from ``start``: counted here (``count``: the main process), and
        ``tagged`` as (worker, samples, counters or None, item) for ``RegionalLoader``."""
        reader = self._reader(worker, start)
        made = make_items(reader.samples(), self._item_size, self.collate_fn, self.tensors, start)
        ship = StatsShipper(self.chain(), item_count(len(reader), self._item_size)) if start.tagged else None
        if ship is not None and not count:  # a worker: its first failure per tier is logged by the rank's process
            self.chain().defer_warnings()
        try:
            for i, (n, item) in enumerate(made):
                if count:
                    self.record(worker, n)
                yield item if ship is None else (worker, n, ship.take(i), item)
        except GeoshardError as e:
            if ship is None or count:
                raise
            # DataLoader would re-raise it wrapped in a worker traceback; the loader raises it as is.
            yield worker, 0, None, WorkerFailure(e)
        finally:
            reader.close()

    def stats(self) -> dict[str, Any]:
        """Counters of this process's tier chain, and the epoch's remainder."""
        out = self.chain().stats.snapshot().to_dict()
        out.update(self.remainder())
        out["epoch"] = self.epoch
        return out


def _check_sizes(prefetch: int, batch_size: int | None) -> None:
    if prefetch < 0:
        raise ConfigError(f"prefetch must be 0 or more shards, got {prefetch}")
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")


def _own_region(region: str | None, topology: Topology | None, environ: Mapping[str, str] | None) -> str:
    """The dataset's region: the topology's (which ``region=`` must match), else ``resolve_region``."""
    if topology is not None:
        if region is not None and region != topology.region:
            raise ConfigError(f"region={region!r} but this rank's topology puts it in {topology.region}")
        region = topology.region
    return resolve_region(region, read_environment(environ))
