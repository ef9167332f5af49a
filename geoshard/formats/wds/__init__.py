"""WebDataset tar shards: the reader (members grouped into samples as webdataset groups them), the
compact writer, the vectorized window scanner and the fetched-shard indexer."""

from __future__ import annotations

from geoshard.formats.keys import check_key
from geoshard.formats.wds.reader import (
    CHUNK,
    EXTENSIONS,
    OnUnterminated,
    RawSample,
    iter_raw_samples,
    iter_raw_windows,
    iter_samples,
    raw_members,
    sample_fields,
)
from geoshard.formats.wds.writer import BLOCK, Member, TarWriter, member_header

__all__ = [
    "BLOCK",
    "CHUNK",
    "EXTENSIONS",
    "Member",
    "OnUnterminated",
    "RawSample",
    "TarWriter",
    "check_key",
    "iter_raw_samples",
    "iter_raw_windows",
    "iter_samples",
    "member_header",
    "raw_members",
    "sample_fields",
]
