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

import numpy as np
import pytest
from geoshard.loaders.shard import Shard

from geoshard.formats import wds


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
    from geoshard.formats.wds import TarWriter
    from geoshard.hashing import sha256, xxh3_128
    from geoshard.manifest import RegionManifest, ShardEntry

    replica = tmp_path / "eu-west-1"
    replica.mkdir()
    entries = []
    for s in range(3):
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
    # In a child process: if a view faulted (SIGBUS), the child dies, not the test run.
    r = subprocess.run(
        [sys.executable, "-P", "-c", _SCENARIO, str(plan), str(replica)], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"held": 9, "bad": [], "types": ["memoryview"]}
    assert (replica / entries[0].path).read_bytes() == b"\xff" * entries[0].bytes  # the replica did change under the views
