"""Zero-copy samples (``copy=False``): fields are read-only memoryviews of the mapped shard, equal
to the copied ones, and a view that outlives its shard, its dataset and its replica file (evicted,
replaced under the same name) keeps its bytes and never faults."""

from __future__ import annotations

import io
import json
import mmap
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geoshard.formats import wds
from geoshard.loaders.shard import Shard


def _tar(n: int, size: int = 3000) -> bytes:
    f = io.BytesIO()
    w = wds.TarWriter(f)
    for i in range(n):
        w.write_sample([(b"k%04d.img" % i, bytes([i % 251]) * size), (b"k%04d.cls" % i, b"%d" % (i % 10))])
    w.close()
    return f.getvalue()


@pytest.mark.parametrize("fmt", ["wds", "tfrecord"])
def test_views_equal_the_copies_and_are_read_only(tmp_path: Path, fmt: str) -> None:
    if fmt == "wds":
        data = _tar(20)
    else:
        from geoshard.formats import tfrecord

        f = io.BytesIO()
        w = tfrecord.TFRecordWriter(f)
        for i in range(20):
            w.write(b"record %d " % i * (i + 1))
        data = f.getvalue()
    (tmp_path / "s").write_bytes(data)
    with open(tmp_path / "s", "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    copies, views = Shard("s", m, fmt), Shard("s", m, fmt, copy=False)
    assert len(copies) == len(views) == 20
    for i in range(20):
        c, v = copies.sample(i), views.sample(i)
        if fmt == "wds":
            assert isinstance(c, dict) and isinstance(v, dict)
            assert c["__key__"] == v["__key__"]
            assert type(c["img"]) is bytes and type(v["img"]) is memoryview
            assert v["img"].readonly and bytes(v["img"]) == c["img"] and bytes(v["cls"]) == c["cls"]
            arr = np.frombuffer(v["img"], dtype=np.uint8)  # a numpy view, no copy
            assert not arr.flags.writeable and arr[0] == i % 251
        else:
            assert type(v) is memoryview and bytes(v) == c


_SCENARIO = textwrap.dedent(
    """
    import gc, json, sys
    from geoshard.loaders import RegionalDataset
    from geoshard.loaders.local_tier import LocalTier
    from geoshard.manifest import read_region_manifest
    plan, replica = sys.argv[1], sys.argv[2]
    ds = RegionalDataset(plan, "eu-west-1", shuffle=False, copy=False, prefetch=1)
    held = []
    for i, s in enumerate(ds):
        if i % 37 == 0:
            held.append((s["__key__"], s["img"], bytes(s["img"])))  # the view, and a copy to compare with
    del ds, s
    gc.collect()
    tier = LocalTier(replica, region="eu-west-1")
    for shard in read_region_manifest(replica).shards:
        tier.remove(shard.path)  # evicted from the replica
        tier.write(shard.path, b"\\xff" * shard.bytes)  # and a different file under the same name
    gc.collect()
    bad = [k for k, view, want in held if bytes(view) != want or view.obj is None]
    print(json.dumps({"held": len(held), "bad": bad, "types": sorted({type(v).__name__ for _, v, _ in held})}))
    """
)


def test_a_view_outliving_its_shard_and_replica_file_keeps_its_bytes(tmp_path: Path) -> None:
    plan, entries = _replica(tmp_path)
    replica = tmp_path / "eu-west-1"
    # In a child process: if a view faulted (SIGBUS), the child dies, not the test run.
    r = subprocess.run(
        [sys.executable, "-P", "-c", _SCENARIO, str(plan), str(replica)], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"held": 9, "bad": [], "types": ["memoryview"]}
    assert (replica / entries[0].path).read_bytes() == b"\xff" * entries[0].bytes  # the replica did change under the views


def _replica(tmp_path: Path, shards: int = 3) -> tuple[Path, list[Any]]:
    """A local replica of ``shards`` shards of 100 samples (5 KB images) and its plan."""
    from geoshard.formats.wds import TarWriter
    from geoshard.manifest import RegionManifest, ShardEntry
    from geoshard.util.hashing import sha256, xxh3_128

    replica = tmp_path / "eu-west-1"
    replica.mkdir()
    entries = []
    for s in range(shards):
        f = io.BytesIO()
        w = TarWriter(f)
        for i in range(100):
            w.write_sample([(b"s%d-%04d.img" % (s, i), bytes([(s * 7 + i) % 256]) * 5000), (b"s%d-%04d.cls" % (s, i), b"1")])
        w.close()
        data = f.getvalue()
        name = f"{s:05d}-0000-{sha256(data)[:12]}.tar"
        (replica / name).write_bytes(data)
        entries.append(ShardEntry(name, 100, len(data), sha256(data), s, xxh3_128(data)))
    (replica / "manifest.json").write_bytes(RegionManifest("eu-west-1", "wds", 1, "p", tuple(entries)).to_json())
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[regions.eu-west-1]\nweight = 1\nlocal = "{replica}"\n')
    return plan, entries


def _mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (also after it was unlinked: " (deleted)")."""
    return any(line.rstrip().removesuffix(" (deleted)").endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_kept_mapping_serves_the_next_fetch_and_its_bytes_are_checked_every_time(tmp_path: Path) -> None:
    """A local shard stays mapped for its next fetch (no page-table set-up per epoch), but every
    fetch still checks its bytes; a removed or replaced file is never served from, or pinned by,
    an old mapping."""
    import gc

    from geoshard.loaders.chain import AllTiersFailed, build_chain
    from geoshard.plan import load_plan

    plan, entries = _replica(tmp_path)
    replica = tmp_path / "eu-west-1"
    chain = build_chain(load_plan(plan), "eu-west-1")
    first = chain.fetch(entries[0])
    assert isinstance(first, mmap.mmap) and chain.fetch(entries[0]) is first  # kept: mapped once
    assert chain.fetch(entries[1]) is not first and _mapped(replica / entries[0].path)

    # Damaged in place (same inode, same size): the kept mapping shows it, and the check refuses it.
    good = (replica / entries[0].path).read_bytes()
    with open(replica / entries[0].path, "r+b") as f:
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 1]))
    with pytest.raises(AllTiersFailed, match=f"{entries[0].path} does not match its manifest"):
        chain.fetch(entries[0])
    assert not (replica / entries[0].path).exists()  # the corrupt copy is removed
    del first
    gc.collect()
    assert not _mapped(replica / entries[0].path)  # and no longer mapped: its disk space is free

    # Written again (a new file under the same name): a new mapping, the right bytes.
    chain.local.write(entries[0].path, good)  # type: ignore[union-attr]
    again = chain.fetch(entries[0])
    assert isinstance(again, mmap.mmap) and again[:] == good
    assert chain.fetch(entries[0]) is again
