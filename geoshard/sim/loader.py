"""The loader's fetch pipeline per region: time to the first batch, IO wait after it, bytes per tier.

- First batch: ``startup_s`` (the worker processes; ``s3_startup_s`` more where they read a
  bucket: each makes its own S3 client), the manifest read
  (a request, then its bytes), then the first shard: a request and ``shard_bytes`` over the path to
  the bucket the region reads (links.transfer_s on a fresh flow) or from the local/Alluxio tier.
  On a host whose ``host_cores`` all ranks share (the rehearsal), the ranks that start together
  share them: the start-up takes ranks / cores times as long (``startup_s``).
- After it, each rank's ``num_workers`` workers fetch whole shards at the tier's rate (or the
  link's, for another region's bucket) while the rank consumes batch x accum x sample_bytes per
  step: supply = workers·shard/(fetch), demand = bytes per step / step time. With
  supply >= demand the wait is the per-batch hand-off (``batch_s``); below it the rank waits
  for the missing share: step·(demand/supply - 1).
- Another region's bucket (bench/get_probe.py measured it): a worker's first fetch goes on a new
  connection (a handshake, then a window both ends start small: links.new_connection_s) and is
  its first piece, the chunks its first batch spans (loaders/pieces.py), not a whole shard. The
  fetch queue starts its second piece while the first is still arriving, so the client's pool opens
  a second new connection for it; the worker waits for it if the batches its first piece holds
  are done before it lands: one stall a run (``second_piece_stall_s``), spread over the steps.
- A link to another region's bucket is shared: the region's ranks x workers fetch over it at
  once (a TCP flow each), so each flow gets the link's rate over their count and the region's
  supply is the link's rate, not a worker's full rate times the workers.
- Bytes per tier: the shards the rank's samples span, plus what the workers prefetched ahead
  (workers x prefetch shards), each at most the region's corpus once per epoch read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from geoshard.sim.config import LinkSpec, RegionSpec, SimConfig
from geoshard.sim.links import new_connection_s, one_way, rate, transfer_s

LEAD_BYTES = 256 << 10  # loaders/fetchqueue.py's: a piece starts once the ones before it have this much left


@dataclass(frozen=True)
class LoaderPrediction:
    time_to_first_batch_s: float
    io_wait_s_per_step: float  # after the first batch
    tier_bytes: float  # bytes the region's ranks fetch from their tier
    egress_bytes: float  # of which from another region's bucket
    fetch_s: float  # one shard's fetch


def shard_fetch_s(cfg: SimConfig, region: RegionSpec, nbytes: float, flows: int = 1, new_connection: bool = False) -> float:
    """One fetch of ``nbytes``; ``flows``: the fetches sharing the link to another region's bucket;
    ``new_connection``: on a connection opened for it (another region's bucket only: a tier in the
    region opens one in no time)."""
    k = cfg.constants
    link = remote_link(cfg, region, flows)
    if link is None:
        return k.request_s + nbytes / k.tier_rate(region.tier)
    if new_connection:
        return k.request_s + new_connection_s(nbytes, link, k)
    return k.request_s + one_way(link) + transfer_s(nbytes, link, k)  # the request out, the bytes back


def remote_link(cfg: SimConfig, region: RegionSpec, flows: int) -> LinkSpec | None:
    """The link to the bucket ``region`` reads as one of ``flows`` flows; None for its own bucket or another tier."""
    source = region.data_region or region.name
    if region.tier != "s3" or source == region.name:
        return None
    return shared(cfg.link(region.name, source), flows, cfg)


def first_piece_bytes(cfg: SimConfig) -> float:
    """A worker's first piece: the whole chunks its first batch spans, at most a shard."""
    batch = cfg.batch_size * cfg.sample_bytes
    return float(min(cfg.shard_bytes, math.ceil(batch / cfg.chunk_bytes) * cfg.chunk_bytes))


def second_piece_stall_s(cfg: SimConfig, region: RegionSpec, flows: int, step_s: float) -> float:
    """How long worker 0 waits, once, for its second piece on a new connection: requested when its
    first piece has ``LEAD_BYTES`` left to arrive (the fetch queue's rule: that long before the
    first batch), needed once the batches its first piece holds are consumed (the rank takes its
    workers' batches in turn, ``accum_steps`` a step). Later epochs' workers start ``lookahead``
    batches ahead (loaders/loader.py), which the model takes to hide their own."""
    link = remote_link(cfg, region, flows)
    if link is None:
        return 0.0
    k = cfg.constants
    piece = first_piece_bytes(cfg)
    batches = max(1, int(piece // (cfg.batch_size * cfg.sample_bytes)))
    covered = (batches * max(1, cfg.num_workers) // cfg.accum_steps) * step_s
    early = transfer_s(piece, link, k, fresh=True) - transfer_s(max(0.0, piece - LEAD_BYTES), link, k, fresh=True)
    fetch = shard_fetch_s(cfg, region, min(cfg.chunk_bytes, cfg.shard_bytes), flows, new_connection=True)
    return max(0.0, fetch - early - covered)


def shared(link: LinkSpec | None, flows: int, cfg: SimConfig) -> LinkSpec | None:
    """``link`` as one of ``flows`` concurrent flows sees it: its rate (cap or forwarder ceiling) over their count."""
    if link is None or flows <= 1:
        return link
    return replace(link, bandwidth_mbit=rate(link, cfg.constants) * 8 / 1e6 / flows)


def starting_together(cfg: SimConfig, region: RegionSpec) -> int:
    """The ranks whose loaders start with ``region``'s: one world's ranks all enter the loop within
    a fraction of a second, after the collectives that make its loader; a DiLoCo region is its own
    world, and the regions' loops began 0.5-2.1 s apart (bench/simulate_bench.py's ``starts``,
    12-07), longer than a start-up takes."""
    return region.ranks if cfg.sync == "diloco" else cfg.world_size


def startup_s(cfg: SimConfig, region: RegionSpec) -> float:
    """The loader's start-up for ``region``'s last rank: ``startup_s``, plus ``s3_startup_s`` where
    its workers read a bucket; longer where the ranks starting together outnumber the cores they
    share (processor sharing: each gets cores / ranks of one)."""
    k = cfg.constants
    alone = k.startup_s + (k.s3_startup_s if region.tier == "s3" else 0.0)
    if not k.host_cores:
        return alone
    return alone * max(1.0, starting_together(cfg, region) / k.host_cores)


def region_loader(cfg: SimConfig, region: RegionSpec, step_s: float) -> LoaderPrediction:
    """``step_s``: the rank's time per optimizer step without data wait (compute and sync)."""
    k = cfg.constants
    flows = region.ranks * max(1, cfg.num_workers)  # every worker of the region fetches at once
    manifest = shard_fetch_s(cfg, region, cfg.manifest_bytes, region.ranks)  # one manifest read per rank
    fetch = shard_fetch_s(cfg, region, cfg.shard_bytes, flows)
    remote = remote_link(cfg, region, flows) is not None
    # from another region's bucket, the worker's first piece on its own new connection
    piece = shard_fetch_s(cfg, region, first_piece_bytes(cfg), flows, new_connection=True) if remote else fetch
    first = startup_s(cfg, region) + manifest + piece
    per_step = cfg.batch_size * cfg.accum_steps * cfg.sample_bytes
    supply = max(1, cfg.num_workers) * cfg.shard_bytes / fetch  # bytes/s a rank's workers deliver (on a shared link)
    demand = per_step / step_s if step_s > 0 else math.inf
    handoff = cfg.accum_steps * k.batch_s
    wait = handoff if supply >= demand else handoff + per_step / supply - step_s
    wait += second_piece_stall_s(cfg, region, flows, step_s) / cfg.steps
    consumed = per_step * cfg.steps  # per rank
    shards = math.ceil(consumed / cfg.shard_bytes) + max(1, cfg.num_workers) * max(1, cfg.prefetch)
    fetched = float(shards * cfg.shard_bytes)
    if region.samples > 0:  # at most the rank's share of the corpus per epoch it reads
        share = region.samples * cfg.sample_bytes / region.ranks
        epochs = math.ceil(consumed / share) if share > 0 else 1
        fetched = min(fetched, epochs * share)
    total = fetched * region.ranks
    return LoaderPrediction(first, wait, total, total if remote else 0.0, fetch)
