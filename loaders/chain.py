"""The tier chain of one reading region: Alluxio cache, local replica, the region's bucket, then
(if allowed) other regions' buckets, counted as egress: each such read is reserved against the
rank's egress budget before it starts (``egress.py``), and past the budget the loader stops.

Every fetched shard is checked against the manifest (size and xxh3-128, or sha256 with
``verify="sha256"`` or where the manifest predates the fast hash); a mismatch is counted, the
next tier is tried, and a corrupt local copy is removed. A tier that fails (down, timeout) is
skipped for ``cooldown_s``, so a dead Alluxio costs one timeout, not one per shard. Transient
failures are retried with backoff before the tier is given up. A shard fetched from a bucket is
written back to the local replica.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from geoshard.errors import ConfigError, DataError, StorageError
from geoshard.loaders.egress import EgressCounter
from geoshard.loaders.stats import LoaderStats
from geoshard.loaders.tier import Progress, Tier, TierError, TierMissing, WritableTier, make_tier
from geoshard.manifest import MANIFEST, RegionManifest, ShardChunks, ShardEntry, chunkindex, parse_region_manifest
from geoshard.plan import Plan
from geoshard.util.hashing import verify_digest, xxh3_128
from geoshard.util.retry import Backoff

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_ONCE = "; its later failures are counted in the report's tiers table, not logged again by this process"


@dataclass(frozen=True)
class ChainSettings:
    # Per tier kind, seconds of silence before a request fails (connect and read): an endpoint that
    # accepts connections and never answers costs (backoff.attempts x this) before the next tier.
    timeouts: tuple[tuple[str, float], ...] = (("alluxio", 2.0), ("local", 10.0), ("s3", 10.0))
    cooldown_s: float = 30.0
    backoff: Backoff = field(default_factory=lambda: Backoff(attempts=2, base=0.2, cap=2.0))
    # Other regions' buckets: None takes the plan's [egress] (off unless cross_region = true).
    allow_cross_region: bool | None = None
    # Bytes a rank may read from other regions' buckets; None takes the plan's egress.budget. Held
    # against the chain's EgressCounter: one per rank, shared by its loader workers (egress.py).
    egress_budget: int | None = None
    writeback: bool = True
    local_limit_bytes: int | None = None  # cap on the local replica; least recently used shards go first
    # "xxh3" checks every fetched shard against its fast hash of record (sha256 where the manifest
    # has no xxh3_128); "sha256" is the cryptographic check, several times slower per byte (measured
    # in docs/benchmarks.md, loaders section); "size" trusts the bytes and checks only the length.
    verify: str = "xxh3"

    def __post_init__(self) -> None:
        if self.verify not in ("xxh3", "sha256", "size"):
            raise ConfigError(f"verify must be 'xxh3', 'sha256' or 'size', got {self.verify!r}")

    def timeout(self, kind: str) -> float:
        return dict(self.timeouts).get(kind, 30.0)


class AllTiersFailed(StorageError):
    """No tier could serve a shard; the message names it and every tier's failure."""


class EgressBudgetExceeded(StorageError):
    """A cross-region read would take this rank past its egress budget: the loader stops."""


class TierChain:
    def __init__(
        self,
        region: str,
        tiers: Sequence[Tier],
        settings: ChainSettings | None = None,
        stats: LoaderStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        egress: EgressCounter | None = None,
        origin: Tier | None = None,
    ) -> None:
        self.region = region
        self.tiers = list(tiers)
        self.settings = settings or ChainSettings()
        self.stats = stats or LoaderStats()
        self.egress = egress or EgressCounter()
        self._clock, self._sleep = clock, sleep
        self._down_until: dict[str, float] = {}
        self._warned: set[str] = set()
        # A DataLoader worker's first failure per tier, kept for the rank's process to log (defer_warnings).
        self._deferred: dict[str, str] | None = None
        # The replica shards fetched from further away are written back to.
        self.local = next((t for t in self.tiers if t.writable and isinstance(t, WritableTier)), None)
        # The region's own bucket: where generations are published (loaders/generation.py).
        self.origin = origin
        self._chunks: dict[str, ShardChunks] = {}  # chunk indexes fetched by this process, by shard

    def cooldowns(self) -> dict[str, float]:
        """Tiers cooling down, until when (monotonic clock: the same in every process of a host)."""
        now = self._clock()
        return {name: until for name, until in self._down_until.items() if until > now}

    def note_cooldowns(self, cooldowns: dict[str, float]) -> None:
        """Adopt what another process (a DataLoader worker) learned about failing tiers; that
        process logged the failure, so this one does not again (the next epoch's workers)."""
        for name, until in cooldowns.items():
            self._down_until[name] = max(self._down_until.get(name, 0.0), until)
            self._warned.add(name)

    def defer_warnings(self) -> None:
        """In a DataLoader worker whose items carry its counters to the rank's process (RegionalLoader):
        a tier's first failure travels with them (``take_warnings``) and that process logs it once for
        all its workers, instead of each worker once."""
        if self._deferred is None:
            self._deferred = {}

    def take_warnings(self) -> dict[str, str]:
        """The failures deferred since the last call, by tier (``defer_warnings``)."""
        out = self._deferred or {}
        if self._deferred is not None:
            self._deferred = {}
        return out

    def warn_once(self, warnings: dict[str, str]) -> None:
        """In the rank's process: its workers' deferred failures, one line per tier it has not logged."""
        for name, message in warnings.items():
            if name not in self._warned:
                self._warned.add(name)
                log.warning("%s", message)

    @property
    def reads_chunks(self) -> bool:
        """Whether shards with chunk hashes are read chunk by chunk: not where a whole shard is
        written back to the local replica, nor with ``verify="sha256"`` (chunks have only xxh3)."""
        return self.settings.verify != "sha256" and not (self.settings.writeback and self.local is not None)

    def healthy(self, tier: Tier) -> bool:
        return self._clock() >= self._down_until.get(tier.name, 0.0)

    def fetch(self, shard: ShardEntry) -> bytes | mmap.mmap:
        """The shard's bytes from the nearest tier that has them intact."""

        def attempt(tier: Tier, failures: list[str]) -> bytes | mmap.mmap | None:
            return self._try(tier, shard, failures)

        tier, data = self._nearest(shard, shard.bytes, "", attempt)
        # (A mapping is a replica's own file: only bytes fetched from elsewhere are written back.)
        if self.settings.writeback and self.local is not None and tier is not self.local and isinstance(data, bytes):
            try:
                self.local.write(shard.path, data)
                self.stats.writeback()
            except (OSError, TierError) as e:
                log.warning("write-back of %s to %s failed: %s", shard.path, self.local.name, e)
        return data

    def _nearest(self, shard: ShardEntry, nbytes: int, what: str, attempt: Callable[[Tier, list[str]], Any]) -> tuple[Tier, Any]:
        """The first healthy tier, in order, whose ``attempt`` succeeds (reads from another region
        within the egress budget, and counted); AllTiersFailed with every tier's reason otherwise."""
        failures: list[str] = []
        for tier in self.tiers:
            if not self.healthy(tier):
                failures.append(f"{tier.name}: cooling down after a failure")
                continue
            remote = bool(tier.region and tier.region != self.region)
            if remote:
                self._reserve_egress(tier, shard, nbytes)
            data = None
            try:
                data = attempt(tier, failures)
            finally:
                if remote and data is None:  # not read (missing, failed, raised): the reservation goes back
                    self.egress.release(nbytes)
            if data is None:
                continue
            if remote:
                self.stats.add_egress(tier.region, self.region, nbytes)
            return tier, data
        raise AllTiersFailed(f"shard {shard.path}{what} (region {self.region}): no tier could serve it: " + "; ".join(failures))

    def read_manifest(self) -> RegionManifest:
        """The region manifest from the nearest tier holding a valid one for this region."""
        failures: list[str] = []
        for tier in self.tiers:
            m = self.manifest_from(tier, MANIFEST, failures)
            if m is not None:
                return m
        raise AllTiersFailed(f"region {self.region}: no tier has its {MANIFEST}: " + "; ".join(failures))

    def manifest_from(self, tier: Tier, path: str, failures: list[str], probe: bool = False) -> RegionManifest | None:
        """This region's manifest at ``path`` in ``tier`` (``manifest.json``, or a generation's history
        copy in a bucket), or None with the reason appended to ``failures``. A ``probe`` (which
        generation is newest) leaves the tier's counters and health as they were: the shards'
        reads judge the tier."""
        if not self.healthy(tier):
            failures.append(f"{tier.name}: cooling down after a failure")
            return None
        try:
            m = parse_region_manifest(tier.read(path), f"{tier.name}/{path}")
        except TierMissing as e:
            failures.append(str(e))
            return None
        except TierError as e:
            if not probe:
                self.stats.count(tier.name, "errors")
                self._down_until[tier.name] = self._clock() + self.settings.cooldown_s
            failures.append(str(e))
            return None
        except DataError as e:
            failures.append(str(e))
            return None
        if m.region != self.region:  # another region's bucket holds that region's manifest
            failures.append(f"{tier.name}: its {path} describes region {m.region}")
            return None
        m.table.check_shard_names(f"{tier.name}/{path}")  # another name could make the local tier touch a user's file
        return m

    def with_chunks(self, shard: ShardEntry) -> ShardEntry:
        """``shard`` with its chunks from its chunk index (``<shard>.chunks`` of a version 2
        manifest), fetched once per process from the nearest tier whose copy matches the entry's
        digest; unchanged without an index, or when no tier has it intact (then read whole)."""
        if shard.chunks is not None or not shard.chunk_index:
            return shard
        chunks = self._chunks.get(shard.path)
        if chunks is None:
            try:
                chunks = self._nearest(shard, 0, " chunk index", lambda tier, failures: self._try_index(tier, shard, failures))[1]
            except AllTiersFailed as e:
                log.warning("%s; reading the shard whole", e)
                return shard
            self._chunks[shard.path] = chunks
        return dataclasses.replace(shard, chunks=chunks)

    def _try_index(self, tier: Tier, shard: ShardEntry, failures: list[str]) -> ShardChunks | None:
        name = chunkindex.index_name(shard.path)
        got = self._attempt(tier, failures, lambda: tier.read(name))
        if got is None:
            return None
        data, t0 = got
        try:
            if chunkindex.digest(data) != shard.chunk_index:
                raise DataError(f"{name} does not match the chunk_index of its manifest")
            chunks = ShardChunks.from_index(data, name, shard.bytes, shard.samples)
        except DataError as e:
            self.stats.count(tier.name, "verify_failures")
            failures.append(f"{tier.name}: {e}")
            return None
        self.stats.hit(tier.name, len(data), self._clock() - t0)
        return chunks

    def fetch_chunks(self, shard: ShardEntry, first: int, last: int, progress: Progress | None = None) -> bytes | memoryview:
        """Chunks ``first`` to ``last`` (inclusive) of a shard with chunk hashes, as one buffer, from
        the nearest tier that has them intact. ``progress(n)``: bytes arrived so far (S3 tiers)."""
        c = shard.chunks
        if c is None or not 0 <= first <= last < len(c.bytes):
            raise ValueError(f"{shard.path}: no chunks {first}-{last}")
        offset, length = sum(c.bytes[:first]), sum(c.bytes[first : last + 1])
        what = f" chunk {first}" if first == last else f" chunks {first}-{last}"

        def attempt(tier: Tier, failures: list[str]) -> bytes | memoryview | None:
            return self._try_chunks(tier, shard, first, last, offset, length, failures, progress)

        return self._nearest(shard, length, what, attempt)[1]

    def _try_chunks(
        self,
        tier: Tier,
        shard: ShardEntry,
        first: int,
        last: int,
        offset: int,
        length: int,
        failures: list[str],
        progress: Progress | None,
    ) -> bytes | memoryview | None:
        assert shard.chunks is not None

        got = self._attempt(tier, failures, lambda: tier.read_range(shard.path, offset, length, progress))
        if got is None:
            return None
        data, t0 = got
        bad = self._bad_chunk(shard, first, last, data)
        if bad:
            self.stats.count(tier.name, "verify_failures")
            failures.append(f"{tier.name}: {bad}")
            data = b""  # let go of a mapping before its file goes
            tier.remove_corrupt(shard.path)
            return None
        self.stats.hit(tier.name, len(data), self._clock() - t0)
        return data

    def _attempt(self, tier: Tier, failures: list[str], read: Callable[[], _T]) -> tuple[_T, float] | None:
        """``read()`` with the tier's retries and backoff: (what it read, when the last try began), or
        None when the tier does not have it or is down (then skipped for the cooldown)."""
        delays = self.settings.backoff.delays()
        while True:
            t0 = self._clock()
            try:
                return read(), t0
            except TierMissing as e:
                self.stats.count(tier.name, "misses")
                failures.append(str(e))
                return None
            except TierError as e:
                self.stats.count(tier.name, "errors")
                delay = next(delays, None)
                if delay is None:
                    self._down_until[tier.name] = self._clock() + self.settings.cooldown_s
                    # Once per tier and process, not in a process that inherited the tier's cooldown from one
                    # that logged it, and a worker's through its rank's process: the stats count every failure.
                    message = f"{tier.name} failed ({e}); skipping it for {self.settings.cooldown_s:.0f} s{_ONCE}"
                    first = tier.name not in self._warned
                    self._warned.add(tier.name)
                    if first and self._deferred is not None:
                        self._deferred[tier.name] = message
                    log.log(logging.WARNING if first and self._deferred is None else logging.DEBUG, "%s", message)
                    failures.append(str(e))
                    return None
                self._sleep(delay)

    def _bad_chunk(self, shard: ShardEntry, first: int, last: int, data: bytes | memoryview) -> str:
        """What is wrong with chunks ``first``-``last`` in ``data`` ("" when they match the manifest)."""
        c = shard.chunks
        assert c is not None
        expected = sum(c.bytes[first : last + 1])
        if len(data) != expected:
            return f"{shard.path} chunks {first}-{last}: {len(data)} of {expected} bytes"
        if self.settings.verify == "size":
            return ""
        view, pos = memoryview(data), 0
        for i in range(first, last + 1):
            end = pos + c.bytes[i]
            if xxh3_128(view[pos:end]) != c.xxh3_128[i]:
                start = sum(c.bytes[:i])
                return f"{shard.path} chunk {i} (bytes {start}-{start + c.bytes[i] - 1}) does not match its manifest's xxh3_128"
            pos = end
        return ""

    def _reserve_egress(self, tier: Tier, shard: ShardEntry, nbytes: int) -> None:
        """Count ``nbytes`` from ``tier`` against the rank's budget before reading them; past it the
        loader stops (EgressBudgetExceeded), nothing read."""
        budget = self.settings.egress_budget
        used = self.egress.reserve(nbytes, budget)
        if used is None:
            used = self.egress.used
            raise EgressBudgetExceeded(
                f"egress budget: reading {shard.path} ({nbytes:,} bytes) from {tier.region}'s bucket into {self.region} "
                f"would bring cross-region reads to {used + nbytes:,} bytes, over the budget of {budget:,} bytes per rank "
                f"(egress.budget in the plan); fill {self.region}'s own copies (geoshard sync, pull) or raise the budget"
            )

    def _try(self, tier: Tier, shard: ShardEntry, failures: list[str]) -> bytes | mmap.mmap | None:
        # A view, not a read: a local replica maps its file, one copy fewer on the hot path.
        got = self._attempt(tier, failures, lambda: tier.view(shard.path))
        if got is None:
            return None
        data, t0 = got
        intact = len(data) == shard.bytes and verify_digest(
            data, sha256_hex=shard.sha256, xxh3_hex=shard.xxh3_128, mode=self.settings.verify
        )
        if not intact:
            self.stats.count(tier.name, "verify_failures")
            failures.append(f"{tier.name}: {shard.path} does not match its manifest ({len(data)} of {shard.bytes} bytes)")
            tier.remove_corrupt(shard.path)
            return None
        self.stats.hit(tier.name, len(data), self._clock() - t0)
        return data


def build_chain(
    plan: Plan,
    region: str,
    settings: ChainSettings | None = None,
    stats: LoaderStats | None = None,
    egress: EgressCounter | None = None,
) -> TierChain:
    """The chain for ``region`` from the plan: alluxio, local, its bucket, then other regions'
    buckets; ``egress``: the rank's cross-region count, when several processes share it."""
    settings = settings or ChainSettings()
    r = plan.region(region)
    tiers: list[Tier] = []
    if r.alluxio and r.bucket:
        if r.alluxio.startswith(("s3+http://", "s3+https://")):  # Alluxio's S3-compatible proxy
            tiers.append(
                make_tier(
                    "s3",
                    bucket=r.bucket_name,
                    prefix=r.bucket_prefix,
                    endpoint=r.alluxio[3:],
                    profile=r.profile,
                    region=region,
                    timeout_s=settings.timeout("alluxio"),
                    name=f"alluxio-s3:{region}",
                )
            )
        else:
            tiers.append(make_tier("alluxio", url=r.alluxio, ufs_root=r.bucket, region=region, timeout_s=settings.timeout("alluxio")))
    if r.local:
        tiers.append(make_tier("local", root=r.local, region=region, limit_bytes=settings.local_limit_bytes))
    cross = plan.egress.cross_region if settings.allow_cross_region is None else settings.allow_cross_region
    if settings.egress_budget is None and plan.egress.budget is not None:
        settings = dataclasses.replace(settings, egress_budget=plan.egress.budget)
    buckets = [r] + ([o for o in plan.regions if o.name != region] if cross else [])
    origin: Tier | None = None
    for b in buckets:
        if b.bucket_name:
            tiers.append(
                make_tier(
                    "s3",
                    bucket=b.bucket_name,
                    prefix=b.bucket_prefix,
                    endpoint=b.endpoint,
                    profile=b.profile,
                    region=b.name,
                    timeout_s=settings.timeout("s3"),
                )
            )
            origin = origin or tiers[-1]
    return TierChain(region, tiers, settings, stats, egress=egress, origin=origin)
