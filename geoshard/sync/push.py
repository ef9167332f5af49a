"""``geoshard sync``: publish each region's shards to its bucket, atomically per region.

Order per region: abort multipart uploads left by an interrupted run; compare the local region
manifest with the bucket's (and its listing); verify every local shard that must move; upload
them with s5cmd (failed objects retried with backoff); check every shard the new manifest names
(size, and the MD5 ETag of single-part uploads); then publish the manifest (a history copy
first, ``manifest.json`` last); then, with ``delete``, remove objects no kept generation names.
A reader of the bucket therefore only ever sees a manifest whose shards are all present.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from geoshard.errors import DataError, GeoshardError, SyncError
from geoshard.manifest import RegionManifest, ShardEntry, chunkindex, parse_region_manifest, read_manifest, read_region_manifest
from geoshard.manifest.lease import LEASES, Lease, history_path
from geoshard.plan import Plan
from geoshard.s3 import REQUEST_TIMEOUT_S
from geoshard.sync.chunk_indexes import upload_chunk_indexes
from geoshard.sync.etag_cache import ETAG_CACHE as ETAG_CACHE  # re-exported: its import path before the split
from geoshard.sync.etag_cache import load_etags, save_etags
from geoshard.sync.plan_match import check_plan_matches
from geoshard.sync.remote import HISTORY, MANIFEST, Bucket, BucketTarget, MissingBucket, RemoteObject
from geoshard.sync.s5cmd import S5cmdError
from geoshard.sync.transfer import Transfer, Transferer
from geoshard.sync.verify_local import check_local, etag_of
from geoshard.util.hashing import FAST
from geoshard.util.retry import Backoff

log = logging.getLogger(__name__)
_sleep = time.sleep  # module-level so tests can record the backoff without touching time.sleep
ProgressFn = Callable[[dict[str, int]], None]


@dataclass(frozen=True)
class SyncSettings:
    regions: tuple[str, ...] = ()  # empty: every region of the plan
    dry_run: bool = False
    delete: bool = False
    keep_generations: int = 1  # previous generations whose shards --delete keeps
    workers: int = 64  # s5cmd --numworkers
    create_buckets: bool = False
    verify_remote: bool = False  # re-download and hash every published shard (ETags catch most damage without it)
    timeout_s: float = REQUEST_TIMEOUT_S  # each S3 request's connect and read bound (two tries)
    default_endpoint: str | None = None
    backoff: Backoff = field(default_factory=lambda: Backoff(attempts=3, base=1.0))


@dataclass
class RegionReport:
    region: str
    uploaded: int = 0
    skipped: int = 0
    bytes_read_locally: int = 0  # shard bytes re-hashed before upload (0 for a no-op: listed ETags compared)
    repaired: int = 0  # shards the bucket held with other bytes than the manifest's, uploaded again
    deleted: int = 0
    failed: int = 0
    bytes_uploaded: int = 0
    aborted_uploads: int = 0
    generation: int = 0
    published: bool = False
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SyncReport:
    regions: dict[str, RegionReport]
    dry_run: bool

    @property
    def ok(self) -> bool:
        return all(r.error is None for r in self.regions.values())

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "ok": self.ok, "regions": {n: r.to_dict() for n, r in self.regions.items()}}


def sync(
    directory: Path, plan: Plan, settings: SyncSettings, transferer: Transferer | None = None, progress: ProgressFn | None = None
) -> SyncReport:
    """Publish every selected region; a failed region keeps its previous manifest, the others go on."""
    top = read_manifest(directory)
    check_plan_matches(directory, top, plan)  # before anything moves
    names = settings.regions or tuple(n for n in plan.region_names if n in top.regions)
    for n in names:
        plan.region(n)  # unknown names are a ConfigError
        if n not in top.regions:
            raise DataError(f"{directory}: the split has no region {n!r}")
    transferer = transferer or Transferer(workers=settings.workers)
    report = SyncReport(regions={name: RegionReport(region=name) for name in names}, dry_run=settings.dry_run)

    def one(name: str) -> None:
        t0 = time.monotonic()
        rr = report.regions[name]
        try:
            local = read_region_manifest(directory / top.regions[name].manifest)
            target = BucketTarget.of(plan.region(name), settings.default_endpoint)
            sync_region(local, (directory / top.regions[name].manifest).parent, target, settings, transferer, rr, progress)
        except GeoshardError as e:
            rr.error = e.message  # the CLI reports it; logged here for library users
            log.info("region %s not published: %s", name, e.message)
        rr.seconds = time.monotonic() - t0

    # Regions in parallel: a region whose endpoint hangs costs its own timeout, not everyone's.
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        list(pool.map(one, names))
    return report


def sync_region(
    local: RegionManifest,
    root: Path,
    target: BucketTarget,
    settings: SyncSettings,
    transferer: Transferer,
    rr: RegionReport,
    progress: ProgressFn | None = None,
    bucket: Bucket | None = None,
) -> None:
    bucket = bucket or Bucket(target, timeout_s=settings.timeout_s)
    t0 = time.monotonic()
    rr.generation = local.generation
    listing, remote_data = _open(bucket, local, settings, rr)
    log.info("%s: listed %d objects in %.2f s", target.region, len(listing), time.monotonic() - t0)
    remote = parse_region_manifest(remote_data, target.url(MANIFEST)) if remote_data else None
    _check_generation(remote, remote_data, local, target)
    etags = load_etags(root)
    cached = dict(etags)
    uploads, md5 = _to_upload(local, root, target, bucket, listing, remote, etags, settings.verify_remote, rr)
    log.info(
        "%s: %d of %d shards to upload, verified locally at %.2f s", target.region, len(uploads), len(local.shards), time.monotonic() - t0
    )
    if not uploads and remote_data == local.to_json():
        rr.published = True  # already the bucket's manifest, and every shard it names is there
        if not settings.dry_run and etags != cached:
            save_etags(root, etags)
        log.info("%s: nothing to do (%.2f s)", target.region, time.monotonic() - t0)
        if settings.delete and not settings.dry_run:
            rr.deleted = bucket.delete(_unreferenced(bucket, listing, local, settings.keep_generations))
        return
    if settings.dry_run:
        rr.uploaded = len(uploads)
        rr.bytes_uploaded = sum(s.bytes for s in uploads)
        rr.deleted = len(_unreferenced(bucket, listing, local, settings.keep_generations)) if settings.delete else 0
        return
    # The MD5s that check the uploads are computed while s5cmd runs (one thread: the upload is
    # latency-bound, and s5cmd needs the other core).
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = {s.path: pool.submit(etag_of, root / s.path) for s in uploads if s.path not in md5}
        _upload(uploads, root, target, transferer, settings.backoff, rr, progress)
        md5.update({p: f.result() for p, f in pending.items()})
    etags.update({s.sha256: md5[s.path] for s in uploads})
    upload_chunk_indexes(bucket, root, local, set(listing), uploads)
    log.info("%s: uploads done at %.2f s", target.region, time.monotonic() - t0)
    after = _publish(bucket, target, local, listing if not uploads else None, md5, etags, root)
    rr.published = True
    log.info("%s: generation %d published at %.2f s", target.region, local.generation, time.monotonic() - t0)
    if settings.delete:
        unreferenced = _unreferenced(bucket, after, local, settings.keep_generations)
        rr.deleted = bucket.delete(unreferenced)


def _open(bucket: Bucket, local: RegionManifest, settings: SyncSettings, rr: RegionReport) -> tuple[dict[str, RemoteObject], bytes | None]:
    """The bucket's listing and manifest; multipart uploads an interrupted run left are aborted."""
    started = datetime.now(UTC)
    # Long links make round trips the fixed cost of a sync: the opening requests go out together.
    with ThreadPoolExecutor(max_workers=3) as pool:
        f_listing = pool.submit(bucket.listing, [sh.path for sh in local.shards])
        f_manifest = pool.submit(bucket.get, MANIFEST)
        f_stale = pool.submit(lambda: list(bucket.stale_multipart_uploads(before=started)))
        try:
            listing, remote_data, stale = f_listing.result(), f_manifest.result(), f_stale.result()
        except MissingBucket:
            if not settings.create_buckets or settings.dry_run:
                raise
            bucket.ensure_bucket(create=True)
            listing, remote_data, stale = {}, None, []
    if not settings.dry_run:
        for key, upload_id in stale:  # left by an interrupted run
            bucket.abort_multipart(key, upload_id)
            rr.aborted_uploads += 1
    return listing, remote_data


def _check_generation(remote: RegionManifest | None, remote_data: bytes | None, local: RegionManifest, target: BucketTarget) -> None:
    if remote and (remote.generation > local.generation or (remote.generation == local.generation and remote_data != local.to_json())):
        # Generations order what --delete keeps; publishing an older or unrelated split would
        # strand readers of the newer one.
        raise SyncError(
            f"{target.url(MANIFEST)}: the bucket holds generation {remote.generation}, local split is generation "
            f"{local.generation}{_difference(remote, local)}; sync from the folder that produced the bucket's generation"
        )


def _to_upload(
    local: RegionManifest,
    root: Path,
    target: BucketTarget,
    bucket: Bucket,
    listing: dict[str, RemoteObject],
    remote: RegionManifest | None,
    etags: dict[str, str],
    verify_remote: bool,
    rr: RegionReport,
) -> tuple[list[ShardEntry], dict[str, str]]:
    """The shards to upload, each verified locally first, and the MD5s read on the way (by path).

    Learns the ETags of shards found intact into ``etags``."""
    published = {s.path: s.sha256 for s in remote.shards} if remote else {}

    # Shards the bucket's manifest names, listed with the size and ETag their bytes give, need no
    # local read; any other listed ETag (an object overwritten or damaged in the bucket) is
    # re-checked and uploaded again.
    def intact(s: ShardEntry) -> bool:
        obj = listing.get(s.path)
        return published.get(s.path) == s.sha256 and obj is not None and obj.size == s.bytes and etags.get(s.sha256) == obj.etag

    todo = [s for s in local.shards if not intact(s)]
    remote_bad = _remote_mismatches(bucket, [s for s in local.shards if intact(s)]) if verify_remote else []
    todo += remote_bad
    damaged = {s.path for s in todo if s.path in published and s.path in listing}
    rr.skipped = len(local.shards) - len(todo)
    rr.bytes_read_locally = sum(s.bytes for s in todo)
    md5 = _check_locally(todo, root, target, listing)
    etags.update({s.sha256: md5[s.path] for s in todo if s.path in md5})
    uploads = [s for s in todo if not (s.path in md5 and _etag_ok(listing[s.path], md5[s.path]))]
    uploads += [s for s in remote_bad if s not in uploads]  # its bytes are wrong whatever its ETag says
    rr.repaired = len([s for s in uploads if s.path in damaged])
    if rr.repaired:
        log.warning("%s: %d shard(s) in the bucket differ from the manifest; uploading them again", target.region, rr.repaired)
    rr.skipped += len(todo) - len(uploads)
    return uploads, md5


def _check_locally(todo: Sequence[ShardEntry], root: Path, target: BucketTarget, listing: dict[str, RemoteObject]) -> dict[str, str]:
    """Verify every shard of ``todo`` against the manifest, every one before any upload; the MD5s
    of those the bucket already holds with the right size, by path."""
    cpus = len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(max_workers=cpus) as pool:  # hashlib releases the GIL
        # Objects an interrupted run already uploaded under their content-addressed names are kept:
        # their MD5 (for the ETag) comes from the same read as the check.
        present = {s.path for s in todo if _same_size(listing.get(s.path), s.bytes)}
        checked = pool.map(lambda s: check_local(s, root / s.path, target.region, md5=s.path in present), todo)
        return {s.path: d for s, d in zip(todo, checked, strict=True) if d is not None}


def _publish(
    bucket: Bucket,
    target: BucketTarget,
    local: RegionManifest,
    listing: dict[str, RemoteObject] | None,
    md5: dict[str, str],
    etags: dict[str, str],
    root: Path,
) -> dict[str, RemoteObject]:
    """Check every shard the manifest names in the bucket (``listing``, or a fresh one when None),
    then publish the manifest; returns the listing checked."""
    data = local.to_json()
    # Readers only open manifest.json, so the history copy (for --delete's bookkeeping) can go up
    # while the check runs; manifest.json itself only after every shard it names is verified.
    with ThreadPoolExecutor(max_workers=2) as pool:
        history = pool.submit(bucket.put, history_path(local.generation), data)
        after = bucket.listing([sh.path for sh in local.shards]) if listing is None else listing
        for s in local.shards:
            obj = after.get(s.path)
            if obj is None or obj.size != s.bytes or (s.path in md5 and not _etag_ok(obj, md5[s.path])):
                raise SyncError(f"{target.url(s.path)}: missing or wrong after upload (size or ETag differs); manifest not published")
        history.result()
    save_etags(root, {s.sha256: after[s.path].etag for s in local.shards if after[s.path].etag == etags.get(s.sha256)})
    bucket.put(MANIFEST, data)
    return after


def _difference(remote: RegionManifest, local: RegionManifest) -> str:
    """What sets the bucket's manifest apart from the local one of the same generation."""
    if remote.generation != local.generation:
        return ""
    if {(s.path, s.sha256) for s in remote.shards} != {(s.path, s.sha256) for s in local.shards}:
        return " with other shards"
    if remote.plan_sha256 != local.plan_sha256:
        return " with the same shards but another plan (plan hash differs)"
    return " with the same shards but another manifest"


def _same_size(obj: RemoteObject | None, size: int) -> bool:
    return obj is not None and obj.size == size


def _etag_ok(obj: RemoteObject, etag: str) -> bool:
    """The listed ETag must be the one s5cmd's upload of the local bytes gives (MD5, or multipart)."""
    return obj.etag == etag


def _remote_mismatches(bucket: Bucket, shards: Sequence[ShardEntry]) -> list[ShardEntry]:
    """``--verify-remote``: shards whose bucket copy, downloaded and hashed, differs from the manifest."""

    def wrong(s: ShardEntry) -> bool:
        algorithm = FAST if s.xxh3_128 else "sha256"
        return bucket.digest(s.path, algorithm) != (s.xxh3_128 or s.sha256)

    with ThreadPoolExecutor(max_workers=8) as pool:
        bad = list(pool.map(wrong, shards))
    return [s for s, b in zip(shards, bad, strict=True) if b]


def _upload(
    uploads: Sequence[ShardEntry],
    root: Path,
    target: BucketTarget,
    transferer: Transferer,
    backoff: Backoff,
    rr: RegionReport,
    progress: ProgressFn | None,
) -> None:
    """Upload until nothing is pending; failed objects (or a failed batch) retry with ``backoff``."""
    pending = {target.url(s.path): s for s in uploads}
    delays = backoff.delays()
    while pending:
        batch = [Transfer(str(root / s.path), url, s.bytes) for url, s in pending.items()]
        try:
            failures = transferer.upload(batch, target, progress)
        except S5cmdError as e:  # the endpoint or credentials failed the whole batch: maybe transient
            delay = next(delays, None)
            if delay is None:
                rr.failed = len(pending)
                raise
            log.warning("%s: upload batch failed (%s); retrying in %.1f s", target.region, e.message, delay)
            _sleep(delay)
            continue
        for url in list(pending):
            if url not in failures:
                s = pending.pop(url)
                rr.uploaded += 1
                rr.bytes_uploaded += s.bytes
        if not pending:
            return
        delay = next(delays, None)
        if delay is None:
            rr.failed = len(pending)
            url, err = next(iter(failures.items()))
            raise SyncError(f"{target.region}: {len(pending)} shard(s) failed to upload, e.g. {url}: {err}; manifest not published")
        log.warning("%s: %d upload(s) failed; retrying in %.1f s", target.region, len(pending), delay)
        _sleep(delay)


def _unreferenced(bucket: Bucket, listing: dict[str, RemoteObject], current: RegionManifest, keep: int) -> list[str]:
    """Objects under the prefix that neither this manifest, the ``keep`` previous ones, nor a
    generation a live lease names (docs/guarantees.md section 11) need. Expired leases go too."""
    leased, live_leases = _leased(bucket, listing)
    kept_history = [history_path(current.generation)]
    referenced = {s.path for s in current.shards}
    previous = 0
    for p in sorted((p for p in listing if p.startswith(HISTORY + "/")), reverse=True):
        gen = _history_generation(p)
        if p in kept_history or gen is None or gen >= current.generation or (previous >= keep and gen not in leased):
            continue
        data = bucket.get(p)
        if data is None:
            continue
        m = parse_region_manifest(data, bucket.target.url(p))
        previous += 1
        kept_history.append(p)
        referenced |= {s.path for s in m.shards}
    if missing := leased - {current.generation} - {_history_generation(p) for p in kept_history}:
        log.warning("%s: generation(s) %s named by a live lease have no history manifest here", bucket.target.region, sorted(missing))
    keep_set = referenced | {chunkindex.index_name(p) for p in referenced} | set(kept_history) | live_leases | {MANIFEST}
    return sorted(p for p in listing if p not in keep_set)


def _history_generation(path: str) -> int | None:
    stem = path.rsplit("/", 1)[-1].removesuffix(".json")
    return int(stem) if stem.isdigit() else None


def _leased(bucket: Bucket, listing: dict[str, RemoteObject]) -> tuple[set[int], set[str]]:
    """The generations live leases name, and their paths (an unreadable lease stays, keeping nothing)."""
    now = time.time()
    generations: set[int] = set()
    live: set[str] = set()
    for p in (p for p in listing if p.startswith(LEASES + "/")):
        data = bucket.get(p)
        if data is None:  # gone since the listing
            continue
        try:
            lease = Lease.parse(data, bucket.target.url(p))
        except DataError as e:
            log.warning("%s: %s; the lease is left in place and keeps no generation", bucket.target.region, e.message)
            live.add(p)
            continue
        if lease.live(now):
            generations |= set(lease.generations)
            live.add(p)
    return generations, live
