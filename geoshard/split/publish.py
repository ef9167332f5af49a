"""Atomic publication of a split: shards first, region manifests next, the top manifest last.

A reader that opens any manifest finds every shard it names complete, and in a version 2 region
every chunk index it records. Shards of the previous
generation stay until the next publication, so a job that started on them can finish.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from geoshard.errors import DataError
from geoshard.manifest import MANIFEST, Manifest, RegionManifest, chunkindex, read_region_manifest
from geoshard.util.fsutil import write_atomic
from geoshard.util.paths import is_shard_name

log = logging.getLogger(__name__)
TMP = ".geoshard-tmp"
KEYS = ".geoshard-keys"  # sorted 64-bit key hashes per group: duplicate checks for incremental splits


def publish(out: Path, tmpdir: Path, manifest: Manifest, regions: Mapping[str, RegionManifest], keys: Mapping[int, bytes]) -> None:
    previous: dict[str, set[str]] = {}
    for name in regions:
        try:
            previous[name] = {s.path for s in read_region_manifest(out / name / MANIFEST).shards}
        except DataError:
            previous[name] = set()
    for name, rm in regions.items():
        rdir = out / name
        rdir.mkdir(parents=True, exist_ok=True)
        for shard in rm.shards:
            src = tmpdir / name / shard.path
            dst = rdir / shard.path
            if not src.exists():  # kept from the previous generation by an incremental split
                if not dst.exists():
                    raise DataError(f"{dst}: shard kept from generation {manifest.generation - 1} is missing; run a full split")
            elif dst.exists() and dst.stat().st_size == shard.bytes:
                src.unlink()  # same content-addressed name: the bytes are already there
            else:
                os.replace(src, dst)
    for name, rm in regions.items():
        _write_chunk_indexes(out / name, rm)
    for gid, hashes in keys.items():
        write_atomic(out / KEYS / f"{gid:05d}.u64", hashes)
    for name, rm in regions.items():
        write_atomic(out / name / MANIFEST, rm.to_json())
    write_atomic(out / MANIFEST, manifest.to_json())
    for name, rm in regions.items():
        keep = previous[name] | set(rm.table.paths()) | {MANIFEST}
        for f in (out / name).iterdir():
            stem = f.name.removesuffix(chunkindex.SUFFIX)  # a chunk index goes with its shard
            if f.is_file() and stem not in keep and is_shard_name(stem):  # only what a split writes
                log.info("removing %s (in neither this nor the previous generation)", f)
                f.unlink()
    shutil.rmtree(tmpdir.parent, ignore_errors=True)  # the run folder and the empty .geoshard-tmp


def _write_chunk_indexes(rdir: Path, rm: RegionManifest) -> None:
    """A version 2 region's ``<shard>.chunks`` beside each shard, before the manifest that records
    their digests (kept shards get theirs too: a version 1 manifest held their chunks inline)."""
    if rm.version < 2:
        return
    table = rm.table
    for i in range(len(table)):
        blob = table.chunk_blob(i)
        if blob:
            write_atomic(rdir / chunkindex.index_name(table.path(i)), blob)


def manifest_sha(rm: RegionManifest) -> str:
    return hashlib.sha256(rm.to_json()).hexdigest()
