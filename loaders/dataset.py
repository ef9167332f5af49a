"""``RegionalDataset``: a PyTorch ``IterableDataset`` over one region's shards, read through the
tier chain (Alluxio, local replica, the region's bucket, other regions' buckets).

The epoch's order is computed from the manifest alone (``epoch.py``), so each rank and DataLoader
worker knows which shards it needs before reading any: they are prefetched in that order, and a
resumed run skips what was consumed without reading it again. The chain (S3 clients, Alluxio
sessions, thread pools) is built lazily in the process that iterates, never pickled.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from geoshard.loaders.chain import ChainSettings, TierChain, build_chain
from geoshard.loaders.decode import DecodeSpec, apply, collate, make_decoder
from geoshard.loaders.epoch import Layout, Remainder, rank_plan
from geoshard.loaders.prefetch import Prefetcher
from geoshard.loaders.shard import Shard
from geoshard.loaders.stats import LoaderStats
from torch.utils.data import IterableDataset, get_worker_info

from geoshard.env import Environment, read_environment
from geoshard.errors import ConfigError, GeoshardError
from geoshard.manifest import RegionManifest
from geoshard.plan import Plan, load_plan

log = logging.getLogger(__name__)
STATE_VERSION = 1
_STATS_EVERY_S = 0.25  # how often a DataLoader worker ships its counters with a batch


class WorkerFailure:
    """A geoshard error raised in a DataLoader worker, carried to the training process intact."""

    def __init__(self, error: GeoshardError) -> None:
        self.error = error


def resolve_region(region: str | None, env: Environment) -> str:
    """``region=``, else GEOSHARD_REGION, else the AWS region variables."""
    r = region or env.geoshard_region or env.region
    if not r:
        raise ConfigError("no region: pass region=..., or set GEOSHARD_REGION (or AWS_REGION) to the region this node runs in")
    return r


def _distributed() -> tuple[int, int] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


class RegionalDataset(IterableDataset[Any]):
    """Samples of one region, split across ranks and DataLoader workers with equal counts per rank.

    ``RegionalDataset(plan, region="eu-west-1", shuffle=False, seed=0)`` yields, for WebDataset,
    ``{"__key__": str, field: bytes, ...}`` and for TFRecord the record bytes (or, with
    ``decode="example"``, the parsed ``tf.train.Example`` as a dict of numpy arrays).
    With ``batch_size``, items are batches made by ``collate_fn`` inside the worker (what
    ``make_loader`` uses: one pickled object per batch instead of one per sample).
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
        rank: int | None = None,
        world_size: int | None = None,
        remainder: Remainder = "drop",
        batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        settings: ChainSettings | None = None,
        allow_cross_region: bool | None = None,
        manifest: RegionManifest | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan if isinstance(plan, Plan) else load_plan(Path(plan))
        self.region = resolve_region(region, read_environment(environ))
        self.plan.region(self.region)  # unknown region: a ConfigError naming the plan's regions
        dist = _distributed()
        if dist is not None and (rank is None or world_size is None):
            rank, world_size = dist
        self.rank, self.world_size = rank or 0, world_size or 1
        if prefetch < 0:
            raise ConfigError(f"prefetch must be 0 or more shards, got {prefetch}")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.layout = Layout(
            rank=self.rank,
            world_size=self.world_size,
            batch_size=batch_size or 1,
            seed=seed,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            remainder=remainder,
        )
        self.batched = batch_size is not None
        self.collate_fn = collate_fn or collate
        self.prefetch = prefetch
        self.settings = settings or ChainSettings()
        if allow_cross_region is not None:
            self.settings = dataclasses.replace(self.settings, allow_cross_region=allow_cross_region)
        self.epoch = 0
        self._chain: TierChain | None = None
        self._inherited_cooldowns: dict[str, float] = {}
        self.manifest = manifest or self.chain().read_manifest()
        self.decoder = make_decoder(decode, self.manifest.format)
        self._counts = [s.samples for s in self.manifest.shards]
        # Progress of the current epoch per logical worker, in samples; and where a resume starts.
        self._consumed = [0]
        self._next_worker = 0
        self._resume: tuple[list[int], int] | None = None
        self._tagged = False  # set by RegionalLoader: items carry the worker's identity and counters
        self._worker_start: tuple[list[int], int, int] | None = None  # (skips, rotation, epoch) for forked workers

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
        total, w = sum(self._counts), self.world_size
        return total // w if self.layout.remainder == "drop" else -(-total // w)

    def __len__(self) -> int:
        """Items (samples, or batches with ``batch_size``) this rank yields per epoch."""
        n = self._per_rank()
        return -(-n // self.layout.batch_size) if self.batched else n

    def remainder(self) -> dict[str, int]:
        total = sum(self._counts)
        per = self._per_rank()
        return {
            "dropped_samples": max(0, total - per * self.world_size),
            "padded_samples": max(0, per * self.world_size - total),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the epoch: enough for ``load_state_dict`` to continue exactly."""
        return {
            "version": STATE_VERSION,
            "region": self.region,
            "generation": self.manifest.generation,
            "epoch": self.epoch,
            "seed": self.layout.seed,
            "shuffle": self.layout.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.layout.batch_size,
            "num_workers": len(self._consumed),
            "consumed": list(self._consumed),
            "next_worker": self._next_worker,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mine = self.state_dict()
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        for k in ("region", "generation", "seed", "shuffle", "rank", "world_size", "batch_size"):
            if state.get(k) != mine[k]:
                raise ConfigError(f"loader state does not fit this loader: {k} is {state.get(k)!r} there, {mine[k]!r} here")
        self.epoch = int(state["epoch"])
        self._consumed = [int(c) for c in state["consumed"]]
        self._next_worker = int(state["next_worker"])
        self._resume = (list(self._consumed), self._next_worker)

    def _start(self, num_workers: int) -> tuple[list[int], int]:
        """Begin an iteration: the per-worker skips and the worker rotation it starts with."""
        if self._resume is not None:
            skip, rotation = self._resume
            self._resume = None
            if len(skip) != num_workers:
                raise ConfigError(
                    f"loader state was saved with {len(skip)} DataLoader worker(s); resume with the same number, not {num_workers}"
                )
            return skip, rotation
        self._consumed, self._next_worker = [0] * num_workers, 0
        return [0] * num_workers, 0

    def record(self, worker: int, samples: int) -> None:
        """Count samples handed to the consumer (the loader calls this for its workers' items)."""
        self._consumed[worker] += samples
        self._next_worker = (worker + 1) % len(self._consumed)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:  # the main process: one logical worker, counted here
            skip, _ = self._start(1)
            return self._generate(0, 1, skip[0], count=True, epoch=self.epoch)
        # A DataLoader worker: the loader started the iteration in the main process before forking.
        if self._chain is not None:
            # Forked with the training process's chain: its pooled connections are shared with the
            # parent and the sibling workers (responses would cross). Build our own, keep what failed.
            self._inherited_cooldowns = self._chain.cooldowns()
            self._chain = None
        skip, rotation, epoch = self._worker_start or ([0] * info.num_workers, 0, self.epoch)
        if len(skip) != info.num_workers:  # a plain DataLoader, not make_loader's: no resume
            skip, rotation = [0] * info.num_workers, 0
        worker = (info.id + rotation) % info.num_workers
        return self._generate(worker, info.num_workers, skip[worker], count=False, epoch=epoch)

    def _generate(self, worker: int, num_workers: int, skip: int, count: bool, epoch: int) -> Iterator[Any]:
        layout = dataclasses.replace(self.layout, num_workers=num_workers)
        plan = rank_plan(self._counts, epoch, layout)
        shards, idx = plan.worker_stream(worker, layout, epoch)
        shard_ids, indices = shards[skip:].tolist(), idx[skip:].tolist()
        last_use = {s: i for i, s in enumerate(shard_ids)}
        order = list(dict.fromkeys(shard_ids))
        chain = self.chain()
        entries = self.manifest.shards
        fmt = self.manifest.format

        def fetch(s: int) -> Shard:
            return Shard(entries[s].path, chain.fetch(entries[s]), fmt)

        prefetcher: Prefetcher[Shard] = Prefetcher(fetch, order, self.prefetch)
        open_shards: dict[int, Shard] = {}
        decoder = self.decoder
        bs = self.layout.batch_size if self.batched else 0
        batch: list[Any] = []
        last = len(shard_ids) - 1
        shipped = time.monotonic()
        try:
            for i, (s, j) in enumerate(zip(shard_ids, indices, strict=True)):
                shard = open_shards.get(s)
                if shard is None:
                    shard = open_shards[s] = prefetcher.get(s)
                item = shard.sample(j)
                if decoder is not None:
                    item = apply(decoder, item, shard.path)
                if last_use[s] == i:
                    del open_shards[s]  # its last sample this epoch: let the memory go
                if bs:
                    batch.append(item)
                    if len(batch) < bs and i < last:
                        continue
                    n, item, batch = len(batch), self.collate_fn(batch), []
                else:
                    n = 1
                if count:
                    self.record(worker, n)
                if not self._tagged:
                    yield item
                    continue
                # Counters travel with an item now and then (and with the last), not with every one.
                stats = None
                if i == last or time.monotonic() - shipped >= _STATS_EVERY_S:
                    stats, shipped = chain.stats.snapshot(), time.monotonic()
                    stats["cooldowns"] = chain.cooldowns()
                yield worker, n, stats, item
        except GeoshardError as e:
            if not self._tagged or count:
                raise
            # DataLoader would re-raise it wrapped in a worker traceback; the loader raises it as is.
            yield worker, 0, None, WorkerFailure(e)
        finally:
            prefetcher.close()

    def stats(self) -> dict[str, Any]:
        """Counters of this process's tier chain, and the epoch's remainder."""
        out = self.chain().stats.snapshot()
        out.update(self.remainder())
        out["epoch"] = self.epoch
        return out
