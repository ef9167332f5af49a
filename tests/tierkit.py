"""A local replica of random shards beside an Alluxio tier that nothing serves: the demo's dead Alluxio."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from geoshard.loaders.local_tier import LocalTier
from geoshard.loaders.tier import make_tier
from geoshard.local.ports import free_ports
from geoshard.manifest import ShardEntry


def replica_beside_dead_alluxio(tmp_path: Path, shards: int) -> tuple[dict[str, bytes], list[ShardEntry], LocalTier, int]:
    """(bytes by path, manifest entries, the replica, a port nothing listens on) for region eu-west-1."""
    (port,) = free_ports(1)  # nothing listens there, as in the demo
    data = {f"00000-{i:04d}-x.tar": os.urandom(1000 + i) for i in range(shards)}
    (tmp_path / "local").mkdir()
    for p, b in data.items():
        (tmp_path / "local" / p).write_bytes(b)
    entries = [ShardEntry(p, 1, len(b), hashlib.sha256(b).hexdigest()) for p, b in data.items()]
    return data, entries, LocalTier(tmp_path / "local", region="eu-west-1"), port


def dead_alluxio(port: int) -> Any:
    """An Alluxio tier of eu-west-1 on ``port``, where nothing listens."""
    return make_tier("alluxio", url=f"http://127.0.0.1:{port}", ufs_root="s3://b/train", region="eu-west-1", timeout_s=0.3)
