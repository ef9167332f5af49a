"""WebDataset as the registry sees it: tar shards of samples that carry their own keys and fields."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, BinaryIO

from geoshard.formats._window import Readable
from geoshard.formats.spec import FieldValue, FormatSpec, LoadHooks, OnUnterminated, SampleBatch, SplitHooks, SynthSample
from geoshard.formats.wds.index import index_tar
from geoshard.formats.wds.reader import EXTENSIONS, iter_raw_samples, iter_raw_windows, raw_members, sample_fields
from geoshard.formats.wds.writer import BLOCK, TarWriter

if TYPE_CHECKING:
    from geoshard.plan.routing import RouteSpec


def _detect(head: bytes) -> bool:
    return len(head) >= 262 and head[257:262] == b"ustar"


def _batches(stream: Readable, url: str, size: int | None, unterminated: OnUnterminated | None) -> Iterator[SampleBatch]:
    """A read window's samples at a time: views into one reused buffer, valid until the next batch."""
    for buf, keys, starts, ends in iter_raw_windows(stream, url, unterminated, size, reuse=True):
        mv = memoryview(buf)
        yield keys, [mv[s:e] for s, e in zip(starts, ends, strict=True)], None


def _field_value(route: RouteSpec, url: str) -> FieldValue:
    value = route.wds_value()

    def read(raw: Any, body: Any, key: bytes | None, index: int) -> tuple[str | None, str]:
        return value(bytes(raw)), repr((key or b"").decode(errors="replace"))

    return read


def _write_synthetic(f: BinaryIO, samples: Iterable[SynthSample]) -> None:
    """``<key>.img``, ``<key>.cls`` and ``<key>.json`` (``{"label", "origin"}``) per sample."""
    tw = TarWriter(f)
    for s in samples:
        meta = json.dumps({"label": s.label, "origin": s.origin}).encode()
        tw.write_sample(
            [(f"{s.key}.img".encode(), s.image), (f"{s.key}.cls".encode(), str(s.label).encode()), (f"{s.key}.json".encode(), meta)]
        )
    tw.close()


def _field_names(raw: bytes) -> list[str]:
    """Members by extension, and the keys of its JSON member as ``json.a`` (``json.a.b`` when nested)."""
    members = raw_members(raw)
    names = set(sample_fields(members))
    for name, data in members:
        if name.endswith(b".json"):
            with contextlib.suppress(ValueError):  # not JSON: only its member name is listed
                names.update(_json_paths(json.loads(data), "json"))
    return sorted(names)


def _json_paths(v: object, prefix: str, depth: int = 3) -> list[str]:
    if not isinstance(v, dict) or depth == 0:
        return []
    out = []
    for k, sub in v.items():
        out.append(f"{prefix}.{k}")
        out.extend(_json_paths(sub, f"{prefix}.{k}", depth - 1))
    return out


SPEC = FormatSpec(
    name="wds",
    suffix=".tar",
    extensions=EXTENSIONS,
    load=LoadHooks(index=index_tar, decoders=MappingProxyType({})),
    named_fields=True,
    detect=_detect,
    trailer=bytes(2 * BLOCK),  # the end-of-archive blocks
    min_sample_bytes=BLOCK,  # at least one member's header
    samples=iter_raw_samples,
    field_names=_field_names,
    split=SplitHooks(batches=_batches, keyed_by_feature=False, feature_keys=None, field_value=_field_value),
    write_synthetic=_write_synthetic,
)
