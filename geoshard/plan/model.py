"""The region plan: which regions exist, how much of the corpus each gets, and where it lives.

A plan is loaded from TOML once, at the edge, validated completely, and passed down as frozen
dataclasses. Every validation error names the key (and its line when the file is at hand) and is
a :class:`ConfigError` (exit 2).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from geoshard.errors import ConfigError
from geoshard.plan.names import is_region_name, region_name_problem
from geoshard.plan.sniff import refuse_other_files
from geoshard.util import tomlfile
from geoshard.util.paths import plain_relative
from geoshard.util.units import parse_size

Policy = Literal["hash", "field", "replicate"]
POLICIES: tuple[str, ...] = ("hash", "field", "replicate")
DEFAULT_SHARD_BYTES = 64 * 10**6

_TOP_KEYS = {"routing", "shards", "regions", "egress"}
_EGRESS_KEYS = {"cross_region", "budget"}
_ROUTING_KEYS = {"policy", "key", "field", "default_region", "map"}
_SHARD_KEYS = {"bytes", "samples"}
_REGION_KEYS = {"weight", "bucket", "endpoint", "profile", "alluxio", "local"}


@dataclass(frozen=True)
class Region:
    name: str
    weight: float
    bucket: str | None = None  # s3://bucket/prefix
    endpoint: str | None = None
    profile: str | None = None
    alluxio: str | None = None
    local: str | None = None

    @property
    def bucket_name(self) -> str | None:
        return None if self.bucket is None else self.bucket[5:].split("/", 1)[0]

    @property
    def bucket_prefix(self) -> str:
        if self.bucket is None:
            return ""
        rest = self.bucket[5:].split("/", 1)
        return rest[1].strip("/") if len(rest) > 1 else ""


@dataclass(frozen=True)
class Routing:
    policy: Policy = "hash"
    key: str | None = None
    field: str | None = None
    default_region: str | None = None
    map: tuple[tuple[str, str], ...] = ()

    def lookup(self) -> dict[str, str]:
        return dict(self.map)


@dataclass(frozen=True)
class ShardTarget:
    bytes: int = DEFAULT_SHARD_BYTES
    samples: int = 0  # 0: no sample limit


@dataclass(frozen=True)
class Egress:
    """Reading other regions' buckets, which costs egress: off unless the plan turns it on."""

    cross_region: bool = False  # fall back to other regions' buckets when the own region's copies fail
    budget: int | None = None  # bytes per job and rank read from other regions' buckets; None: no cap


@dataclass(frozen=True)
class Plan:
    regions: tuple[Region, ...]
    routing: Routing = field(default_factory=Routing)
    shards: ShardTarget = field(default_factory=ShardTarget)
    egress: Egress = field(default_factory=Egress)
    path: str | None = field(default=None, compare=False)

    @property
    def region_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise ConfigError(f"{self.path or 'plan'}: unknown region {name!r}; plan has {', '.join(self.region_names)}")

    def to_dict(self) -> dict[str, Any]:
        """Normalized form: defaults filled in, keys sorted; stored in the manifest."""
        routing: dict[str, Any] = {"policy": self.routing.policy}
        for k in ("key", "field", "default_region"):
            v = getattr(self.routing, k)
            if v is not None:
                routing[k] = v
        if self.routing.map:
            routing["map"] = dict(sorted(self.routing.map))
        regions = {}
        for r in self.regions:
            d: dict[str, Any] = {"weight": r.weight}
            for k in ("bucket", "endpoint", "profile", "alluxio", "local"):
                v = getattr(r, k)
                if v is not None:
                    d[k] = v
            regions[r.name] = d
        out = {
            "routing": routing,
            "shards": {"bytes": self.shards.bytes, "samples": self.shards.samples},
            "regions": regions,
        }
        if self.egress != Egress():  # only when set: plans without it keep their digest
            out["egress"] = {"cross_region": self.egress.cross_region, "budget": self.egress.budget}
        return out

    def sha256(self) -> str:
        return _digest(self.to_dict())

    def layout_sha256(self) -> str:
        """Hash of what decides shard contents (routing, sizes, region names and weights), not storage targets."""
        d = self.to_dict()
        d["regions"] = {n: {"weight": r["weight"]} for n, r in d["regions"].items()}
        d.pop("egress", None)  # who may read across regions does not change a shard
        return _digest(d)


def _digest(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_plan(path: str | Path) -> Plan:
    return parse_plan(tomlfile.read_text(path, "plan"), source=str(Path(path)))


def parse_plan(text: str, source: str = "plan") -> Plan:
    refuse_other_files(text, source)
    return plan_from_dict(tomlfile.loads(text, source), source=source, text=text)


def plan_from_dict(doc: dict[str, Any], source: str = "plan", text: str | None = None) -> Plan:
    """Validate a decoded plan. ``text`` (the TOML) only serves to name lines in errors."""
    v = _Checker(source, text)
    v.unknown(doc, _TOP_KEYS, "")
    regions_doc = v.table(doc.get("regions", {}), "regions")
    if not regions_doc:
        raise v.fail("regions", "the plan has no regions; add at least one [regions.<name>] table")
    regions = tuple(_region(v, name, rd) for name, rd in regions_doc.items())
    routing = _routing(v, v.table(doc.get("routing", {}), "routing"), {r.name for r in regions})
    shards = _shards(v, v.table(doc.get("shards", {}), "shards"))
    egress = _egress(v, v.table(doc.get("egress", {}), "egress"))
    _shared_prefixes(v, regions)
    return Plan(regions=regions, routing=routing, shards=shards, egress=egress, path=source)


class _Checker:
    """Errors that name the key, and its line when the TOML text is at hand."""

    def __init__(self, source: str, text: str | None) -> None:
        self.source, self.text = source, text

    def fail(self, key: str, msg: str) -> ConfigError:
        line = _line_of(self.text, key) if self.text else None
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {key}: {msg}")

    def table(self, d: Any, key: str) -> dict[str, Any]:
        if not isinstance(d, dict):
            raise self.fail(key, "must be a table")
        return d

    def unknown(self, d: dict[str, Any], allowed: set[str], prefix: str) -> None:
        for k in d:
            if k not in allowed:
                raise self.fail(f"{prefix}{k}", f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def opt_str(self, d: dict[str, Any], k: str, prefix: str) -> str | None:
        v = d.get(k)
        if v is not None and (not isinstance(v, str) or not v):
            raise self.fail(f"{prefix}{k}", "must be a non-empty string")
        return v


def _region(v: _Checker, name: str, doc: Any) -> Region:
    prefix = f"regions.{name}."
    if not is_region_name(name):
        raise v.fail(f"regions.{name}", region_name_problem(name))
    rd = v.table(doc, f"regions.{name}")
    v.unknown(rd, _REGION_KEYS, prefix)
    if "weight" not in rd:
        raise v.fail(f"{prefix}weight", "missing; every region needs a weight > 0")
    weight = rd["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise v.fail(f"{prefix}weight", f"must be a finite number > 0, got {weight!r}")
    return Region(
        name=name,
        weight=weight,
        bucket=_bucket(v, rd, prefix),
        endpoint=_url(v, rd, prefix, "endpoint", r"^https?://[^\s/]+", "an http(s):// URL"),
        # A worker's HTTP API (http://host:port), or Alluxio's S3-compatible proxy (s3+http://host:port).
        alluxio=_url(v, rd, prefix, "alluxio", r"^(s3\+)?https?://[^\s/]+", "http(s)://worker:port or s3+http(s)://proxy:port"),
        profile=v.opt_str(rd, "profile", prefix),
        local=v.opt_str(rd, "local", prefix),
    )


def _bucket(v: _Checker, rd: dict[str, Any], prefix: str) -> str | None:
    bucket = v.opt_str(rd, "bucket", prefix)
    if bucket is not None and not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,62}(/.*)?$", bucket):
        raise v.fail(f"{prefix}bucket", f"must be an s3://bucket/prefix URL, got {bucket!r}")
    key_prefix = bucket[5:].partition("/")[2].strip("/") if bucket else ""
    if key_prefix:
        try:
            plain_relative(key_prefix, "prefix")
        except ConfigError:
            raise v.fail(f"{prefix}bucket", f"the key prefix must be plain (no '.', '..' or empty parts), got {bucket!r}") from None
    return bucket


def _shared_prefixes(v: _Checker, regions: tuple[Region, ...]) -> None:
    """Two regions in one place of one bucket would overwrite each other's manifest, and one's
    ``sync --delete`` would remove the other's shards: refused, as is one prefix inside another."""
    seen: list[Region] = []
    for r in regions:
        if r.bucket is None:
            continue
        for o in seen:
            if (o.endpoint, o.bucket_name) != (r.endpoint, r.bucket_name):
                continue
            a, b = sorted((o.bucket_prefix, r.bucket_prefix), key=len)
            if a == b or not a or b.startswith(a + "/"):
                where = f"s3://{r.bucket_name}/{a}" if a else f"s3://{r.bucket_name}"
                inside = "the same prefix" if a == b else "one prefix inside the other"
                raise v.fail(
                    f"regions.{r.name}.bucket",
                    f"regions {o.name} and {r.name} share {where} ({inside}); give each region its own bucket or prefix",
                )
        seen.append(r)


def _url(v: _Checker, rd: dict[str, Any], prefix: str, k: str, pattern: str, what: str) -> str | None:
    url = v.opt_str(rd, k, prefix)
    if url is None:
        return None
    if not re.match(pattern, url):
        raise v.fail(f"{prefix}{k}", f"must be {what}, got {url!r}")
    # The plan is copied into every manifest: a user:password@ there would be published.
    if "@" in url.split("://", 1)[-1].split("/", 1)[0]:
        raise v.fail(f"{prefix}{k}", "must not carry credentials (user:password@); use the AWS_* variables or a profile")
    return url


def _routing(v: _Checker, rt: dict[str, Any], names: set[str]) -> Routing:
    v.unknown(rt, _ROUTING_KEYS, "routing.")
    policy = rt.get("policy", "hash")
    if policy not in POLICIES:
        raise v.fail("routing.policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    key = v.opt_str(rt, "key", "routing.")
    fld = v.opt_str(rt, "field", "routing.")
    default_region = v.opt_str(rt, "default_region", "routing.")
    mapping = v.table(rt.get("map", {}), "routing.map")
    for value, region in mapping.items():
        if not isinstance(region, str) or region not in names:
            raise v.fail(f"routing.map.{value}", f"maps to unknown region {region!r}; plan has {', '.join(sorted(names))}")
    if policy == "field":
        if fld is None:
            raise v.fail("routing.field", 'field routing needs the field to route by, e.g. field = "json.origin"')
        if not mapping:
            raise v.fail("routing.map", "field routing needs a [routing.map] table of value = region")
    if default_region is not None and default_region not in names:
        raise v.fail("routing.default_region", f"unknown region {default_region!r}; plan has {', '.join(sorted(names))}")
    return Routing(
        policy=policy,
        key=key,
        field=fld,
        default_region=default_region,
        map=tuple(sorted((str(k), r) for k, r in mapping.items())),
    )


def _shards(v: _Checker, sd: dict[str, Any]) -> ShardTarget:
    v.unknown(sd, _SHARD_KEYS, "shards.")
    try:
        shard_bytes = parse_size(sd.get("bytes", DEFAULT_SHARD_BYTES))
    except ValueError as e:
        raise v.fail("shards.bytes", str(e)) from e
    if shard_bytes < 1024:
        raise v.fail("shards.bytes", f"must be at least 1KB, got {shard_bytes}")
    samples = sd.get("samples", 0)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise v.fail("shards.samples", f"must be an integer >= 0, got {samples!r}")
    return ShardTarget(bytes=shard_bytes, samples=samples)


def _egress(v: _Checker, ed: dict[str, Any]) -> Egress:
    v.unknown(ed, _EGRESS_KEYS, "egress.")
    cross_region = ed.get("cross_region", False)
    if not isinstance(cross_region, bool):
        raise v.fail("egress.cross_region", f"must be true or false, got {cross_region!r}")
    budget = None
    if "budget" in ed:
        try:
            budget = parse_size(ed["budget"])
        except ValueError as e:
            raise v.fail("egress.budget", str(e)) from e
    return Egress(cross_region=cross_region, budget=budget)


def _line_of(text: str, dotted: str) -> int | None:
    """Best-effort line of ``dotted`` (e.g. ``regions.eu.weight``) in the TOML text."""
    parts = dotted.split(".")
    lines = text.splitlines()
    # Find the deepest table header that is a prefix of the key, then the key below it.
    for cut in range(len(parts), 0, -1):
        header = ".".join(parts[:cut])
        hdr = re.compile(r"^\s*\[\s*(" + re.escape(header) + r")\s*\]")
        for i, line in enumerate(lines):
            if hdr.match(line.replace('"', "")):
                if cut == len(parts):
                    return i + 1
                leaf = parts[cut]
                keyre = re.compile(r'^\s*"?' + re.escape(leaf) + r'"?\s*=')
                for j in range(i + 1, len(lines)):
                    if lines[j].lstrip().startswith("["):
                        break
                    if keyre.match(lines[j]):
                        return j + 1
                return i + 1
    leaf = parts[-1]
    keyre = re.compile(r'^\s*"?' + re.escape(leaf) + r'"?\s*=')
    for i, line in enumerate(lines):
        if keyre.match(line):
            return i + 1
    return None
