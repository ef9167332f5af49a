"""The ETags of shards whose bytes matched the manifest, by sha256, in the region's folder.

Names are content-addressed, so an entry never goes stale: a resync compares every listed ETag
without reading the shards again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from geoshard.util.fsutil import write_atomic

log = logging.getLogger(__name__)

ETAG_CACHE = ".geoshard-etags.json"


def load_etags(root: Path) -> dict[str, str]:
    try:
        data = json.loads((root / ETAG_CACHE).read_bytes())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def save_etags(root: Path, etags: dict[str, str]) -> None:
    try:
        write_atomic(root / ETAG_CACHE, json.dumps(etags, sort_keys=True).encode())
    except OSError as e:  # a read-only split folder: the next sync reads the shards again
        log.info("cannot cache ETags in %s: %s", root, e)
