"""``geoshard pull``: fill a local replica of a region from its bucket, every shard verified.

s5cmd does not verify downloads, so each shard lands under a temporary name, is checked against
the bucket's manifest and only then renamed into place; the replica's manifest is written last.
Shards already present and correct are not fetched again, and not read again either: a file
that verified is recorded in ``.geoshard-pull-state.json`` with its size, mtime, ctime and inode
(geoshard/sync/stat_state.py), so a no-op pull stats and compares; a file whose stat or expected
digest changed is hashed again, and ``geoshard verify`` re-hashes everything. The check is the
manifest's xxh3_128
by default (memory speed; sha256 where the manifest predates it), or sha256 with
``verify="sha256"`` (a cryptographic check); the size is checked first in both.

A version 2 region's chunk indexes (``<shard>.chunks``) come in the same batches, each checked
against its entry's ``chunk_index`` and against its shard (the chunks add up to it), and are
renamed into place only once everything verified, just before the manifest: a replica holds
the indexes of the manifest it holds, so ``geoshard verify`` and the loader's local tier can use
them as they use the bucket's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError, StorageError, SyncError
from geoshard.manifest import MANIFEST, ShardEntry, chunkindex, parse_region_manifest
from geoshard.manifest.verify import algorithm_for, index_matches, shard_matches
from geoshard.plan import Plan
from geoshard.s3 import REQUEST_TIMEOUT_S
from geoshard.sync.remote import Bucket, BucketTarget
from geoshard.sync.stat_state import FileStat, StatState, settle
from geoshard.sync.transfer import Transfer, Transferer
from geoshard.util.fsutil import write_atomic
from geoshard.util.hashing import FAST
from geoshard.util.retry import Backoff

log = logging.getLogger(__name__)
_sleep = time.sleep  # module-level so tests can record the backoff without touching time.sleep
_PARTIAL = ".partial"
STATE = ".geoshard-pull-state.json"  # what each verified file looked like (the no-op quick check)


@dataclass(frozen=True)
class PullSettings:
    to: Path
    workers: int = 64
    timeout_s: float = REQUEST_TIMEOUT_S  # each S3 request's connect and read bound (two tries)
    backoff: Backoff = field(default_factory=lambda: Backoff(attempts=3, base=1.0))
    verify: str = "xxh3"  # "xxh3" (the manifest's xxh3_128, sha256 where it has none) or "sha256"


@dataclass
class PullReport:
    region: str
    downloaded: int = 0
    skipped: int = 0
    failed: int = 0
    bytes_downloaded: int = 0
    seconds: float = 0.0
    hash: str = ""  # the digest every shard was checked by: "xxh3_128", "sha256", or both ("sha256+xxh3_128")
    indexes_downloaded: int = 0  # chunk indexes of a version 2 region (<shard>.chunks), checked by their entry's chunk_index
    indexes_skipped: int = 0
    stat_matched: int = 0  # files (shards and indexes) found unchanged by their recorded stat: not read
    rehashed: int = 0  # local files read and hashed to decide whether to fetch them
    bytes_rehashed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def pull_targets(plan: Plan, regions: Sequence[str], to: Path | None) -> tuple[list[tuple[str, Path]], dict[str, str]]:
    """The (region, replica folder) pairs to pull and the regions left out, with why. ``to``
    serves one region; otherwise each region's ``local`` of the plan, and with no ``regions``
    every region that has one (a region without is skipped, not an error)."""
    for name in regions:
        plan.region(name)  # an unknown region: one line naming the plan's regions
    if to is not None:
        if len(regions) != 1:
            names = ", ".join(plan.region_names)
            raise ConfigError(f"--to {to}: the replica of one region; name it with --region (the plan has {names})")
        return [(regions[0], to)], {}
    targets, skipped = [], {}
    for name in regions or plan.region_names:
        local = plan.region(name).local
        if local is None:
            if regions:
                raise ConfigError(f"region {name}: no --to, and the plan sets no regions.{name}.local; pass --to DIR or set it")
            skipped[name] = f"no regions.{name}.local in the plan"
        else:
            targets.append((name, Path(local)))
    if not targets:
        raise ConfigError(f"{plan.path or 'the plan'}: no region has a local folder; set regions.<name>.local, or pass --region R --to DIR")
    return targets, skipped


@dataclass(frozen=True)
class _Item:
    """One object to fetch: a shard, or (``index``) the chunk index beside it (version 2)."""

    shard: ShardEntry
    index: bool = False

    @property
    def path(self) -> str:
        return chunkindex.index_name(self.shard.path) if self.index else self.shard.path

    def matches(self, file: Path, mode: str) -> bool:
        return index_matches(file, self.shard) if self.index else shard_matches(file, self.shard, mode)

    def tag(self, mode: str) -> str:
        """What the file's bytes must match: recorded beside its stat once they did."""
        if self.index:
            return f"chunks:{self.shard.chunk_index}"
        algorithm = algorithm_for(self.shard, mode)
        return f"{algorithm}:{self.shard.xxh3_128 if algorithm == FAST else self.shard.sha256}"


def _present(item: _Item, root: Path, mode: str, state: StatState, report: PullReport) -> bool:
    """Whether the replica already holds ``item``: its recorded stat, else its bytes re-hashed."""
    file, tag = root / item.path, item.tag(mode)
    if state.unchanged(item.path, file, tag):
        report.stat_matched += 1
        return True
    seen = FileStat.of(file)
    if seen is None or (not item.index and seen.size != item.shard.bytes):
        return False  # missing, or a shard of the wrong size: fetched without reading it
    report.rehashed += 1
    report.bytes_rehashed += seen.size
    if not item.matches(file, mode):
        return False
    state.record(item.path, file, tag, seen)
    return True


def pull(
    target: BucketTarget,
    settings: PullSettings,
    transferer: Transferer | None = None,
    progress: Callable[[dict[str, int]], None] | None = None,
) -> PullReport:
    t0 = time.monotonic()
    bucket = Bucket(target, timeout_s=settings.timeout_s)
    data = bucket.get(MANIFEST)
    if data is None:
        raise StorageError(f"{target.url(MANIFEST)}: no manifest in the bucket; run geoshard sync for region {target.region} first")
    manifest = parse_region_manifest(data, target.url(MANIFEST))
    manifest.table.check_shard_names(target.url(MANIFEST))  # before anything is written: every path stays under --to
    mode = settings.verify
    report = PullReport(region=target.region, hash="+".join(sorted({algorithm_for(s, mode) for s in manifest.shards})))
    root = settings.to
    root.mkdir(parents=True, exist_ok=True)
    items = [_Item(s) for s in manifest.shards] + [_Item(s, index=True) for s in manifest.shards if s.chunk_index]
    state = StatState.load(root / STATE)
    missing = [i for i in items if not _present(i, root, mode, state, report)]
    report.skipped = sum(not i.index for i in items) - sum(not i.index for i in missing)
    report.indexes_skipped = sum(i.index for i in items) - sum(i.index for i in missing)
    seen: dict[str, FileStat] = {}  # each download's stat when it verified, before its rename
    ready = _fetch(target, root, missing, settings, transferer or Transferer(workers=settings.workers), report, progress, seen)
    # An index is renamed into place only once every object verified, just before the manifest:
    # a replica's indexes are those of the manifest it holds, the old one or the new one.
    for tmp in ready:
        os.replace(tmp, tmp.with_name(tmp.name[1 : -len(_PARTIAL)]))
    write_atomic(root / MANIFEST, manifest.to_json())
    if missing:
        settle()  # the files just written are recorded, not left racy
        for i in missing:  # recorded only if nothing wrote to it since it verified
            if i.path in seen:
                state.record(i.path, root / i.path, i.tag(mode), seen[i.path], renamed=True)
    state.save()
    report.seconds = time.monotonic() - t0
    return report


def _fetch(
    target: BucketTarget,
    root: Path,
    missing: list[_Item],
    settings: PullSettings,
    transferer: Transferer,
    report: PullReport,
    progress: Callable[[dict[str, int]], None] | None,
    seen: dict[str, FileStat],
) -> list[Path]:
    """Download and verify ``missing``, with retries; shards are renamed into place as they
    verify, the indexes' verified temporary files are returned. Raises SyncError (the indexes'
    temporary files removed) when some object is still missing after the last try."""
    delays = settings.backoff.delays()
    ready: list[Path] = []
    while missing:
        # Hidden temporary names beside their final place: a rename is then atomic, and loaders
        # reading the replica by its manifest never open a partial file.
        temp = {i.path: (root / i.path).with_name(f".{Path(i.path).name}{_PARTIAL}") for i in missing}
        for t in temp.values():
            t.parent.mkdir(parents=True, exist_ok=True)
        transfers = [Transfer(str(temp[i.path]), target.url(i.path), 0 if i.index else i.shard.bytes) for i in missing]
        failures = transferer.download(transfers, target, progress)
        retry = []
        for i in missing:
            tmp = temp[i.path]
            stat = FileStat.of(tmp)
            if target.url(i.path) in failures or stat is None or not i.matches(tmp, settings.verify):
                tmp.unlink(missing_ok=True)
                retry.append(i)
            elif i.index:
                seen[i.path] = stat
                ready.append(tmp)
                report.indexes_downloaded += 1
            else:
                seen[i.path] = stat
                os.replace(tmp, root / i.path)
                report.downloaded += 1
                report.bytes_downloaded += i.shard.bytes
        missing = retry
        if missing:
            delay = next(delays, None)
            if delay is None:
                for tmp in ready:
                    tmp.unlink(missing_ok=True)
                report.failed = len(missing)
                what = "chunk index(es) or shard(s)" if any(i.index for i in missing) else "shard(s)"
                raise SyncError(
                    f"{target.region}: {len(missing)} {what} could not be fetched and verified, e.g. {target.url(missing[0].path)}; "
                    "the replica's manifest was not updated"
                )
            log.warning("%s: %d download(s) failed or did not verify; retrying in %.1f s", target.region, len(missing), delay)
            _sleep(delay)
    return ready
