"""The sharded all-reduce of the peer-to-peer exchange: each rank all-reduces the shards it owns
with the owners of the same shards in the other member regions (one gloo group per shard and
stream), then the region's ranks all-gather the shards (the region's own group), so every rank
ends with the whole vector.

Each shard is cut into ``streams / S`` chunks (``S`` shards: ``streams`` per pair of regions),
each all-reduced on a group of its own, all at once (``async_op``): several TCP connections per
pair of peers, so one exchange is not held to what one TCP stream gets through a long fat link.
The order of the ranks in each cross-region group is the ring's (``ring``). ``sharded_allreduce``
is the whole thing in one call, for benches; the trainer's exchange (``p2p``) runs the same
steps around its checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp

from geoshard.trainer.diloco.groups import LOOPBACK, Bind, GroupCache, gloo_group
from geoshard.trainer.diloco.settings import SUMMABLE_DTYPES
from geoshard.trainer.diloco.shards import Layout, owner, shard_count

DEFAULT_STREAMS = 8


@dataclass(frozen=True)
class Membership:
    """Who takes part in one exchange: (region, ranks) in ring order, and a name for its groups
    (a new one whenever the membership changes, so stale peers never meet in a group)."""

    members: tuple[tuple[str, int], ...]
    name: str

    def index(self, region: str) -> int:
        return [g for g, _ in self.members].index(region)


def chunks(a: int, b: int, streams: int) -> list[tuple[int, int]]:
    """[a, b) in ``streams`` near-equal pieces (fewer when there are fewer values)."""
    n = max(1, min(streams, b - a))
    base, extra = divmod(b - a, n)
    out, start = [], a
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def per_shard(streams: int, shards: int) -> int:
    """Chunks per shard for ``streams`` per pair of regions: the streams are split over the shards
    (a region's ranks), each shard getting at least one."""
    return max(1, -(-streams // shards))


class ShardGroups:
    """One rank's groups for one membership: per owned shard and stream, a group with one rank
    per member region (ring order); made on first use, kept in ``cache``."""

    def __init__(
        self,
        store: object,
        prefix: str,
        layout: Layout,
        mship: Membership,
        region: str,
        streams: int,
        bind: Bind,
        timeout_s: float,
        cache: GroupCache,
    ) -> None:
        self.layout, self.mship, self.streams = layout, mship, per_shard(streams, layout.shards)
        self._args = (store, prefix, mship.index(region), len(mship.members), bind, timeout_s)
        self._cache = cache

    def group(self, s: int, c: int) -> Any:
        return self._cache.get((self.mship.name, s, c), lambda: self._make(s, c))

    def _make(self, s: int, c: int) -> Any:
        """One group, on a store client of its own (``store.clone()``): groups are made at once,
        and one client's blocking wait would hold every other group's rendezvous behind it."""
        store, prefix, rank, size, bind, timeout_s = self._args
        client = store.clone() if hasattr(store, "clone") else store
        return gloo_group(client, f"{prefix}/x/{self.mship.name}/s{s}/c{c}/", rank, size, bind, timeout_s)

    def make_all(self, shards: Sequence[int]) -> None:
        """Every group of ``shards``' chunks not made yet, all at once (``GroupCache.make_all``)."""
        wanted = [((self.mship.name, s, c), partial(self._make, s, c)) for s in sorted(shards) for c in range(len(self.pieces(s)))]
        self._cache.make_all(wanted)

    def pieces(self, s: int) -> list[tuple[int, int]]:
        """Shard ``s``'s chunks, relative to the shard."""
        a, b = self.layout.span(s)
        return [(x - a, y - a) for x, y in chunks(a, b, self.streams)]


def allreduce_shards(groups: ShardGroups, values: dict[int, torch.Tensor]) -> tuple[dict[int, torch.Tensor], int]:
    """Sum each owned shard over the member regions, in place, every chunk at once; the bytes this
    rank sent (a ring all-reduce of B bytes among m sends 2(m-1)/m B)."""
    works, sent = start_allreduce(groups, values)
    for w in works:
        w.wait()
    return values, sent


def make_groups(groups: ShardGroups, shards: Sequence[int]) -> None:
    """Make (or find in the cache) every group of ``shards``' chunks, all at once: each group meets
    under its own prefix, so no order between ranks is needed."""
    if len(groups.mship.members) > 1:
        groups.make_all(shards)


def start_allreduce(groups: ShardGroups, values: dict[int, torch.Tensor]) -> tuple[list[Any], int]:
    """``allreduce_shards`` without the wait: the works (wait on each) and the bytes sent, so the
    caller can do other work (the MAC's projections) while the chunks travel."""
    m = len(groups.mship.members)
    if m == 1:
        return [], 0
    works, sent = [], 0
    for s in sorted(values):  # every rank makes its groups in the same order: no two wait on each other
        for c, (a, b) in enumerate(groups.pieces(s)):
            piece = values[s][a:b]
            works.append(groups.group(s, c).allreduce([piece], AllreduceOptions()))
            sent += 2 * (m - 1) * piece.numel() * piece.element_size() // m
    return works, sent


WAVES = 1  # parts a shard's sum travels in at most: 2 and 4 waves on the same groups measured slower (docs/benchmarks.md)
WAVE_MIN = 1 << 22  # values in the smallest wave, at least: each wave on a group pays the ring's round trips again


def waves(length: int, count: int) -> list[tuple[int, int]]:
    """[0, length) in up to ``count`` contiguous parts halving in size, the last two equal (1/2,
    1/4, 1/8, 1/8 for 4): what is left after the transfer is the last wave's share; none empty."""
    out, start = [], 0
    for w in range(count):
        size = length - start if w == count - 1 else min(length - start, max(1, (length - start) // 2))
        if size <= 0:
            break
        out.append((start, start + size))
        start += size
    return out


def wave_count(layout: Layout, count: int = WAVES, least: int = WAVE_MIN) -> int:
    """Waves per shard, the same for every shard of the job and on every rank (it depends on the
    job's layout only): the most, up to ``count``, whose smallest wave of the smallest shard keeps
    ``least`` values (1 for smaller shards: a wave costs the ring's latency again, ~0.44 s under
    bench/wan-matrix.toml, more than the MAC pass it would hide there)."""
    smallest = min(b - a for a, b in map(layout.span, range(layout.shards)))
    for c in range(count, 1, -1):
        parts = waves(smallest, c)
        if len(parts) == c and min(b - a for a, b in parts) >= least:
            return c
    return 1


def start_waves(
    groups: ShardGroups, values: dict[int, torch.Tensor], count: int = WAVES, least: int = WAVE_MIN
) -> tuple[list[list[Any]], list[list[tuple[int, int, int]]], int]:
    """``start_allreduce`` in waves: wave ``w`` of every owned shard (``waves``) cut over the
    streams' groups, queued behind wave ``w - 1`` on the same groups (gloo runs a group's
    collectives in order), so the waves land one after another. Per wave its works and its
    (shard, start, stop) parts (relative to the shard), one per chunk in shard and chunk order
    (``works[w][i]`` carries ``spans[w][i]``; one member: no works), and the bytes this rank sent."""
    m, n = len(groups.mship.members), wave_count(groups.layout, count, least)
    works: list[list[Any]] = [[] for _ in range(n)]
    spans: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    sent = 0
    for w in range(n):
        for s in sorted(values):  # every rank queues its groups' collectives in the same order
            for c, (a, b) in enumerate(chunks(*waves(values[s].numel(), n)[w], groups.streams)):
                spans[w].append((s, a, b))
                if m == 1:
                    continue
                piece = values[s][a:b]
                works[w].append(groups.group(s, c).allreduce([piece], AllreduceOptions()))
                sent += 2 * (m - 1) * piece.numel() * piece.element_size() // m
    return works, spans, sent


def gather_in_region(region_group: Any, layout: Layout, own: dict[int, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Every rank of the region gets every shard from its owner: the whole vector (fp32), and the
    bytes this rank sent (an owner sends its shards to the n-1 others)."""
    full = torch.empty(layout.numel, dtype=torch.float32)
    for s, t in own.items():
        a, b = layout.span(s)
        full[a:b] = t
    if layout.n == 1:
        return full, 0
    assert region_group is not None
    works = []
    for s in range(layout.shards):
        a, b = layout.span(s)
        opts = BroadcastOptions()
        opts.rootRank = owner(s, layout.n)
        works.append(region_group.broadcast([full[a:b]], opts))
    for w in works:
        w.wait()
    return full, sum((layout.n - 1) * 4 * t.numel() for t in own.values())


def region_max(region_group: Any, code: int) -> int:
    """The largest ``code`` of the region's ranks: so that all of them take the same decision."""
    if region_group is None:
        return code
    t = torch.tensor([code], dtype=torch.int32)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX  # type: ignore[assignment]
    region_group.allreduce([t], opts).wait()
    return int(t.item())


def sharded_allreduce(
    store: object,
    members: Sequence[tuple[str, int]],
    region: str,
    rank: int,
    flat: torch.Tensor,
    *,
    streams: int = DEFAULT_STREAMS,
    compression: str = "none",
    bind: Bind = LOOPBACK,
    timeout_s: float = 60.0,
    tag: str = "diloco/bench",
    corrupt: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, int]:
    """One sharded all-reduce (sum over the member regions) of ``flat``, which every rank of a
    region holds alike; ``members`` are (region, ranks) in ring order, ``rank`` this rank's
    in-region rank. Collective over every rank of every member; ``store`` (a TCPStore client or
    ``CountingStore``) carries only the groups' rendezvous under ``tag`` (use a new tag per call).
    Returns the sum (fp32) on every rank and the bytes this rank sent. ``corrupt(s, t)`` (tests)
    changes a shard's contribution before it is sent."""
    sizes = dict(members)
    layout = Layout(flat.numel(), shard_count(list(sizes.values())), sizes[region], rank)
    dtype = SUMMABLE_DTYPES[compression]
    cache = GroupCache()
    region_group = None
    if layout.n > 1:
        region_group = gloo_group(store, f"{tag}/region/{region}/", rank, layout.n, bind, timeout_s)
    groups = ShardGroups(store, tag, layout, Membership(tuple(members), "bench"), region, streams, bind, timeout_s, cache)
    values = {s: flat[slice(*layout.span(s))].to(dtype).clone() for s in layout.mine}
    for s, t in values.items():
        if corrupt is not None:
            corrupt(s, t)
    summed, sent = allreduce_shards(groups, values)
    full, gathered = gather_in_region(region_group, layout, {s: t.float() for s, t in summed.items()})
    return full, sent + gathered
