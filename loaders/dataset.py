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
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from geoshard.env import Environment, read_environment
from geoshard.errors import ConfigError, GeoshardError
from geoshard.loaders.balance import Balance, balance
from geoshard.loaders.chain import ChainSettings, TierChain, build_chain
from geoshard.loaders.decode import DecodeSpec, apply, collate, make_decoder, pack, tensor_spec
from geoshard.loaders.epoch import Layout, Remainder, need_positions, per_rank, rank_plan
from geoshard.loaders.fetchqueue import FetchQueue
from geoshard.loaders.pieces import ChunkMap, Piece, WorkerPieces, key, rank_order, worker_pieces
from geoshard.loaders.prefetch import Prefetcher
from geoshard.loaders.shard import Shard
from geoshard.loaders.stats import LoaderStats
from geoshard.loaders.topology import RegionShare, Topology
from geoshard.manifest import RegionManifest
from geoshard.plan import Plan, load_plan

log = logging.getLogger(__name__)
# 2: keyed by region and rank within the region; 3: shuffle windows grow from one batch (epoch.py),
# so a position saved under 2 would point into another order: refused, not resumed wrongly.
STATE_VERSION = 3
_TAR_END = bytes(1024)  # a piece of a tar that ends before the shard does gets end blocks to parse alone
_STATS_EVERY_S = 0.25  # how often a DataLoader worker ships its counters with a batch


class WorkerFailure:
    """A geoshard error raised in a DataLoader worker, carried to the training process intact."""

    def __init__(self, error: GeoshardError) -> None:
        self.error = error


@dataclass(frozen=True)
class EpochStart:
    """How an iteration begins: the epoch, the samples each logical worker skips (a resume), which
    logical worker each DataLoader worker process plays first, and whether items carry the worker's
    identity and counters (``RegionalLoader``'s iterations) or are plain."""

    epoch: int
    skips: tuple[int, ...]
    rotation: int = 0
    tagged: bool = False
    slots: Any = None  # a SlotPool shared with the training process, for TensorSpec batches (slots.py)
    slot_tag: int = 0  # this iteration's mark on the slots its workers fill
    fetch_queue: Any = None  # the rank's fetch order, shared by the workers it forks (fetchqueue.py)

    @property
    def num_workers(self) -> int:
        return len(self.skips)


def resolve_region(region: str | None, env: Environment) -> str:
    """``region=``, else GEOSHARD_REGION, else the AWS region variables."""
    r = region or env.geoshard_region or env.region
    if not r:
        raise ConfigError("no region: pass region=..., or set GEOSHARD_REGION (or AWS_REGION) to the region this node runs in")
    return r


def _single_region_job(region: str) -> tuple[int, int] | None:
    """Under torch.distributed without a region group: the global rank and size, if every rank is in
    ``region``. A job that spans regions must say which ranks share this one (collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    topo = Topology.of(_gather_regions(region), dist.get_rank())
    if topo.spans_regions:
        raise ConfigError(
            f"this job's ranks span regions ({topo.describe()}): pass topology=Topology.discover(region) "
            "(or region_rank=, region_size= and samples_per_rank=) so each region's samples go to its own ranks"
        )
    return topo.rank, topo.world_size


def _gather_regions(region: str) -> list[str]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, region)
    return [str(r) for r in out]


class RegionalDataset(IterableDataset[Any]):
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
    ) -> None:
        super().__init__()
        self.plan = plan if isinstance(plan, Plan) else load_plan(Path(plan))
        if topology is not None:
            if region is not None and region != topology.region:
                raise ConfigError(f"region={region!r} but this rank's topology puts it in {topology.region}")
            region = topology.region
        self.region = resolve_region(region, read_environment(environ))
        self.plan.region(self.region)  # unknown region: a ConfigError naming the plan's regions
        if prefetch < 0:
            raise ConfigError(f"prefetch must be 0 or more shards, got {prefetch}")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.prefetch = prefetch
        self.settings = settings or ChainSettings()
        if allow_cross_region is not None:
            self.settings = dataclasses.replace(self.settings, allow_cross_region=allow_cross_region)
        self.epoch = 0
        self._chain: TierChain | None = None
        self._inherited_cooldowns: dict[str, float] = {}
        self.manifest = manifest or self.chain().read_manifest()
        self.decoder = make_decoder(decode, self.manifest.format)
        self.tensors = tensor_spec(decode, self.manifest.format, batch_size)
        self.copy = copy and self.tensors is None  # a TensorSpec copies each field once, into its batch
        self._counts = [s.samples for s in self.manifest.shards]
        self.share = self._find_share(
            topology,
            region_rank if region_rank is not None else rank,
            region_size if region_size is not None else world_size,
            samples_per_rank,
            remainder,
        )
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
        # Progress of the current epoch per logical worker, in samples; and where a resume starts.
        self._consumed = [0]
        self._next_worker = 0
        self._resume: tuple[list[int], int] | None = None
        self._pending: EpochStart | None = None  # handed over by RegionalLoader for the workers it forks

    def _find_share(
        self, topology: Topology | None, rank: int | None, size: int | None, samples_per_rank: int | None, remainder: Remainder
    ) -> RegionShare:
        """This rank's place in its region and the job-wide samples per rank."""
        self.balance: Balance | None = None
        total = sum(self._counts)
        if topology is not None:
            share = topology.share(samples_per_rank)
            if samples_per_rank is not None:
                return share
            if topology.spans_regions:
                if not topology.live:
                    raise ConfigError("a topology without process groups spans regions: pass samples_per_rank= as well")
                # Collective: every rank's region, sample count and region size decide the job's figure.
                seen = {r: (n, k) for r, n, k in topology.all_gather((self.region, total, share.size))}
                self.balance = balance({r: n for r, (n, _) in seen.items()}, {r: k for r, (_, k) in seen.items()}, remainder)
            else:
                self.balance = balance({self.region: total}, {self.region: share.size}, remainder)
            return topology.share(self.balance.samples_per_rank)
        if rank is None or size is None:
            found = _single_region_job(self.region)  # under torch.distributed: all ranks here, or an error
            rank, size = found if found is not None else (rank or 0, size or 1)
        return RegionShare(self.region, rank, size, samples_per_rank)

    # -- process-local state ------------------------------------------------------------
    def chain(self) -> TierChain:
        if self._chain is None:
            self._chain = build_chain(self.plan, self.region, self.settings, LoaderStats())
            self._chain.note_cooldowns(self._inherited_cooldowns)
        return self._chain

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_chain"] = None  # clients and sessions are per process; what failed is not
        state["_inherited_cooldowns"] = self._chain.cooldowns() if self._chain is not None else {}
        return state

    # -- epochs, length, state ----------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

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

    def __len__(self) -> int:
        """Items (samples, or batches with ``batch_size``) this rank yields per epoch."""
        n = self._per_rank()
        return -(-n // self.layout.batch_size) if self.batched else n

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
            "samples_per_rank": self._per_rank(),
            "batch_size": self.layout.batch_size,
            "num_workers": len(self._consumed),
            "consumed": list(self._consumed),
            "next_worker": self._next_worker,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mine = self.state_dict()
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"loader state version {state.get('version')!r} is not {STATE_VERSION}: it was saved by another geoshard, "
                "whose epoch order differs; restart the epoch (drop the loader state) or resume with that version"
            )
        for k in ("region", "generation", "seed", "shuffle", "region_rank", "region_size", "samples_per_rank", "batch_size"):
            if state.get(k) != mine[k]:
                raise ConfigError(f"loader state does not fit this loader: {k} is {state.get(k)!r} there, {mine[k]!r} here")
        self.epoch = int(state["epoch"])
        self._consumed = [int(c) for c in state["consumed"]]
        self._next_worker = int(state["next_worker"])
        self._resume = (list(self._consumed), self._next_worker)

    def begin(self, num_workers: int, *, tagged: bool = False) -> EpochStart:
        """Begin an iteration of the current epoch: its start, from a loaded state or from zero."""
        if self._resume is not None:
            skip, rotation = self._resume
            self._resume = None
            if len(skip) != num_workers:
                raise ConfigError(
                    f"loader state was saved with {len(skip)} DataLoader worker(s); resume with the same number, not {num_workers}"
                )
            return EpochStart(self.epoch, tuple(skip), rotation, tagged)
        self._consumed, self._next_worker = [0] * num_workers, 0
        return EpochStart(self.epoch, (0,) * num_workers, 0, tagged)

    @contextlib.contextmanager
    def handing_over(self, start: EpochStart) -> Iterator[None]:
        """Within this block, iterations (and the DataLoader workers forked in it) begin at ``start``."""
        self._pending = start
        try:
            yield
        finally:
            self._pending = None

    def items_taken(self) -> int:
        """Items (samples, or batches) of the current epoch handed to the consumer so far."""
        bs = self.layout.batch_size if self.batched else 1
        return sum(-(-c // bs) for c in self._consumed)

    def record(self, worker: int, samples: int) -> None:
        """Count samples handed to the consumer (the loader calls this for its workers' items)."""
        self._consumed[worker] += samples
        self._next_worker = (worker + 1) % len(self._consumed)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        start = self._pending
        if info is None:  # the main process: one logical worker, counted here
            start = start or self.begin(1)
            return self._generate(0, 1, start, count=True)
        # A DataLoader worker, forked inside handing_over() (or by a plain DataLoader: no resume).
        if self._chain is not None:
            # Forked with the training process's chain: its pooled connections are shared with the
            # parent and the sibling workers (responses would cross). Build our own, keep what failed.
            self._inherited_cooldowns = self._chain.cooldowns()
            self._chain = None
        if start is None or start.num_workers != info.num_workers:
            start = EpochStart(self.epoch, (0,) * info.num_workers)
        worker = (info.id + start.rotation) % info.num_workers
        return self._generate(worker, info.num_workers, start, count=False)

    def rank_pieces(self, start: EpochStart) -> tuple[list[WorkerPieces], list[list[int]], list[tuple[np.ndarray, np.ndarray]]]:
        """Per logical worker of this rank: its pieces (after its skip), their places in the rank's
        fetch order, and its stream (shards, indices). The same in every process of the rank."""
        layout = dataclasses.replace(self.layout, num_workers=start.num_workers)
        plan = rank_plan(self._counts, start.epoch, layout)
        cmap = ChunkMap(self.manifest.shards, self.chain().reads_chunks)
        per_worker, streams = [], []
        for w in range(start.num_workers):
            shards, idx = plan.worker_stream(w, layout, start.epoch)
            skip = start.skips[w]
            need = np.maximum(need_positions(len(shards), layout)[skip:], skip) - skip
            per_worker.append(worker_pieces(shards[skip:], idx[skip:], need, cmap))
            streams.append((shards[skip:], idx[skip:]))
        places = rank_order([p.pieces for p in per_worker], self.layout.batch_size, start.rotation)
        return per_worker, places, streams

    def fetch_queue(self, start: EpochStart) -> FetchQueue:
        """The rank's fetch order for an iteration beginning at ``start`` (made before the workers fork)."""
        per_worker, places, _ = self.rank_pieces(start)
        sizes = [0] * sum(len(p.pieces) for p in per_worker)
        for wp, pl in zip(per_worker, places, strict=True):
            for p, g in zip(wp.pieces, pl, strict=True):
                sizes[g] = p.length
        first_round = sum(1 for wp in per_worker for p in wp.pieces if p.need < self.layout.batch_size)
        return FetchQueue(sizes, free=first_round)

    def _generate(self, worker: int, num_workers: int, start: EpochStart, count: bool) -> Iterator[Any]:
        per_worker, places, streams = self.rank_pieces(start)
        mine, place = per_worker[worker], places[worker]
        shard_arr, idx_arr = streams[worker]
        shard_ids, indices, chunk_ids = shard_arr.tolist(), idx_arr.tolist(), mine.chunks.tolist()
        pieces, last_use = mine.pieces, mine.last_use
        fq = start.fetch_queue if isinstance(start.fetch_queue, FetchQueue) and start.fetch_queue.size == sum(map(len, places)) else None
        chain = self.chain()
        entries = self.manifest.shards
        fmt = self.manifest.format
        copy = self.copy
        prefetcher: Prefetcher[Shard]

        def fetch(k: int) -> Shard:
            p: Piece = pieces[k]
            entry, g = entries[p.shard], place[k]
            if fq is not None:
                fq.wait_turn(g, prefetcher.stopped)
            try:
                if not p.chunked:
                    return Shard(entry.path, chain.fetch(entry), fmt, copy=copy)
                progress = (lambda n: fq.arrived(g, n)) if fq is not None else None
                data = chain.fetch_chunks(entry, p.first, p.last, progress)
                assert entry.chunks is not None
                if fmt == "wds" and p.last < len(entry.chunks.bytes) - 1:
                    data = b"".join((data, _TAR_END))
                return Shard(entry.path, data, fmt, copy=copy)
            finally:
                if fq is not None:
                    fq.done(g)

        prefetcher = Prefetcher(fetch, list(range(len(pieces))), self.prefetch, [p.ordinal for p in pieces])
        open_chunks: dict[int, tuple[Shard, int]] = {}  # key(shard, chunk) -> (its piece's Shard, the piece's first sample)
        loaded = 0  # pieces taken from the prefetcher so far
        decoder = self.decoder
        bs = self.layout.batch_size if self.batched else 0
        batch: list[Any] = []
        tensors, paths = self.tensors, []  # with a TensorSpec: each sample's shard, for errors
        last = len(shard_ids) - 1
        shipped = time.monotonic()
        try:
            for i, (s, j, c) in enumerate(zip(shard_ids, indices, chunk_ids, strict=True)):
                k = key(s, c)
                got = open_chunks.get(k)
                while got is None:  # the next pieces in order, up to the one holding this sample
                    p, piece = pieces[loaded], prefetcher.get(loaded)
                    loaded += 1
                    for cc in range(p.first, p.last + 1):
                        open_chunks[key(p.shard, cc)] = (piece, p.sample0)
                    got = open_chunks.get(k)
                shard, base = got
                item = shard.sample(j - base)
                if decoder is not None:
                    item = apply(decoder, item, shard.path)
                if last_use[k] == i:
                    del open_chunks[k]  # its last sample this epoch: let the memory go
                if bs:
                    batch.append(item)
                    if tensors is not None:
                        paths.append(shard.path)
                    if len(batch) < bs and i < last:
                        continue
                    if tensors is not None:
                        n, item = len(batch), pack(tensors, batch, paths, start.slots, start.slot_tag, start.tagged)
                        batch, paths = [], []
                    else:
                        n, item, batch = len(batch), self.collate_fn(batch), []
                else:
                    n = 1
                if count:
                    self.record(worker, n)
                if not start.tagged:
                    yield item
                    continue
                # Counters travel with an item now and then (and with the last), not with every one.
                stats = None
                if i == last or time.monotonic() - shipped >= _STATS_EVERY_S:
                    stats, shipped = (chain.stats.snapshot(), chain.cooldowns()), time.monotonic()
                yield worker, n, stats, item
        except GeoshardError as e:
            if not start.tagged or count:
                raise
            # DataLoader would re-raise it wrapped in a worker traceback; the loader raises it as is.
            yield worker, 0, None, WorkerFailure(e)
        finally:
            prefetcher.close()

    def stats(self) -> dict[str, Any]:
        """Counters of this process's tier chain, and the epoch's remainder."""
        out = self.chain().stats.snapshot().to_dict()
        out.update(self.remainder())
        out["epoch"] = self.epoch
        return out
