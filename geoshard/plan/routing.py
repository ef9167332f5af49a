"""Which region(s) a sample goes to.

``hash``: weighted rendezvous hashing over a fixed table of slots. A sample's key hashes to a
slot (blake2b, stable across machines and Python versions); each slot belongs to the region with
the highest score ``weight / -ln(u)``, where ``u`` is a per-(region, slot) hash. Changing one
weight only moves slots into or out of that region, so a weight change moves close to the minimal
share of samples. ``field``: a value of the sample looked up in the plan's map (data residency).
``replicate``: every region.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from geoshard.errors import ConfigError, DataError
from geoshard.formats import Format, format_spec
from geoshard.formats.example import ExampleError, get_feature
from geoshard.formats.wds import raw_members
from geoshard.plan import Plan

SLOT_BITS = 16
NSLOTS = 1 << SLOT_BITS
_SHIFT = 64 - SLOT_BITS


def slot_table(names: Sequence[str], weights: Sequence[float]) -> bytes:
    """Region index for each of the NSLOTS slots (one byte each)."""
    if len(names) > 255:
        raise ConfigError("plan: at most 255 regions are supported")
    import numpy as np

    log, scale = math.log, 2.0**-64  # a power of two: the same floats as dividing by 2**64
    scores = np.empty((len(names), NSLOTS))
    for idx, (name, weight) in enumerate(zip(names, weights, strict=True)):
        # 8 uniform 64-bit draws per blake2b call keeps table construction in the milliseconds.
        prefix = name.encode() + b":"
        draws = b"".join(hashlib.blake2b(b"%s%d" % (prefix, block), digest_size=64).digest() for block in range(NSLOTS // 8))
        # Each score with math.log, as the table was always computed (numpy's log may differ in the
        # last bit, which could move a slot); numpy only picks the winner: the first region with
        # the highest score, as a strict ">" over regions in order did.
        u = (np.frombuffer(draws, dtype="<u8").astype(np.float64) + 0.5) * scale  # IEEE: as Python's int + 0.5
        scores[idx] = weight / -np.fromiter(map(log, u.tolist()), np.float64, NSLOTS)
    return bytes(np.argmax(scores, axis=0).astype(np.uint8))


def key_hash(key: bytes, _blake: Callable[..., Any] = hashlib.blake2b, _from_bytes: Callable[..., int] = int.from_bytes) -> int:
    """64-bit key hash: its top SLOT_BITS pick the slot, and the whole finds duplicate keys.

    On the split's per-sample path: the defaults bind its two calls as locals."""
    return _from_bytes(_blake(key, digest_size=8).digest(), "little")


class RouteSpec:
    """Everything a worker needs to route, small and picklable (built once on the driver)."""

    def __init__(self, plan: Plan, fmt: Format) -> None:
        self.fmt = fmt
        self.policy = plan.routing.policy
        self.nregions = len(plan.regions)
        self.field = plan.routing.field
        index = {n: i for i, n in enumerate(plan.region_names)}
        self.map = {v: index[r] for v, r in plan.routing.map}
        self.default = index[plan.routing.default_region] if plan.routing.default_region else None
        self.table = slot_table(plan.region_names, [r.weight for r in plan.regions]) if self.policy == "hash" else b""
        self.every = tuple(range(self.nregions))
        self.singles = tuple((i,) for i in range(self.nregions))
        if self.policy == "field" and not format_spec(fmt).named_fields and self.field and self.field.startswith("json."):
            raise ConfigError(
                f"{plan.path or 'plan'}: routing.field: {self.field!r} names a JSON member, "
                "but TFRecord samples have features; name a feature"
            )
        if plan.routing.key is not None and not format_spec(fmt).split.keyed_by_feature:  # ignored: a mistake to see
            raise ConfigError(
                f"{plan.path or 'plan'}: routing.key: {plan.routing.key!r} applies to TFRecord corpora only (the feature "
                "that names a record); WebDataset samples are keyed by their __key__: remove routing.key"
            )

    def by_hash(self, h: int) -> tuple[int, ...]:
        return self.singles[self.table[h >> _SHIFT]]

    def by_value(self, value: str | None, source: str, sample: str, raw: bytes | memoryview = b"") -> tuple[int, ...]:
        """The region of a field value; ``raw`` (the sample or record) is read only to list its fields in an error."""
        idx = self.map.get(value) if value is not None else None
        if idx is None:
            if self.default is None:
                if value is None:
                    raise DataError(f"{source}: sample {sample} has no field {self.field!r}{self._remedy(raw)}")
                raise DataError(
                    f"{source}: sample {sample} has {self.field}={value!r}, which [routing.map] does not map; "
                    "map it or set routing.default_region"
                )
            idx = self.default
        return self.singles[idx]

    def _remedy(self, raw: bytes | memoryview) -> str:
        """What to do about a missing routing field: the sample's fields and the nearest one."""
        names = format_spec(self.fmt).field_names(bytes(raw)) if len(raw) else []
        if not names:
            return "; name a field the samples have in routing.field, or set routing.default_region for samples without it"
        near = difflib.get_close_matches(str(self.field), names, n=1)
        fix = f'set routing.field = "{near[0]}" (the nearest)' if near else "name one of them in routing.field"
        return f" (its fields: {', '.join(names)}); {fix}, or set routing.default_region for samples without it"

    def wds_value(self) -> Callable[[bytes], str | None]:
        """Field value of a WebDataset sample: ``json.a.b`` reads the .json member, else the member ``.<field>``."""
        assert self.field is not None
        if self.field.startswith("json."):
            path = self.field[5:].split(".")

            def from_json(raw: bytes) -> str | None:
                for name, data in raw_members(raw):
                    if name.endswith(b".json"):
                        try:
                            v = json.loads(data)
                            for p in path:
                                v = v[p]
                        except (ValueError, KeyError, TypeError, IndexError):
                            return None
                        return None if isinstance(v, (dict, list)) else str(v)
                return None

            return from_json
        suffix = b"." + self.field.encode()

        def from_member(raw: bytes) -> str | None:
            for name, data in raw_members(raw):
                if name.endswith(suffix):
                    return data.decode("utf-8", "replace").strip()
            return None

        return from_member

    def tfrecord_value(self, source: str) -> Callable[[bytes, int], str | None]:
        assert self.field is not None
        fname = self.field

        def value(record: bytes, index: int) -> str | None:
            try:
                v = get_feature(record, fname)
            except ExampleError as e:
                raise DataError(f"{source}: record {index} is not a tf.train.Example ({e})") from e
            if not v:
                return None
            x = v[0]
            return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)

        return value
