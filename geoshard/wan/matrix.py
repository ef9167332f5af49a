"""The WAN matrix: one-way latency and bandwidth cap per region pair, from TOML.

```toml
[[link]]
a = "us-east-1"
b = "eu-west-1"
latency_ms = 38        # one way, each direction
bandwidth_mbit = 200   # each direction has its own cap; omit for no cap
queue_ms = 100         # optional: the link's buffer, in milliseconds at its rate (drop-tail)
```

A link is symmetric: the same latency and cap apply to a→b and b→a, each direction with its own
token bucket. Every pair of the regions a rehearsal runs must have a link; a missing pair is a
ConfigError (no silent default: a forgotten pair would rehearse a free link). Every error names
the file, the line and the key, on one line.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError
from geoshard.plan.names import check_region_name, is_region_name, region_name_problem
from geoshard.util import tomlfile

_LINK_KEYS = {"a", "b", "latency_ms", "bandwidth_mbit", "queue_ms"}
DEFAULT_QUEUE_MS = 100.0
MAX_LATENCY_MS = 10_000.0


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    latency_ms: float  # one way
    bandwidth_mbit: float | None = None  # None: no cap (the forwarder's ceiling is the limit)
    queue_ms: float = DEFAULT_QUEUE_MS

    @property
    def pair(self) -> frozenset[str]:
        return frozenset((self.a, self.b))

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6 / 8


@dataclass(frozen=True)
class WanMatrix:
    links: tuple[Link, ...]
    path: str = "matrix"

    @property
    def regions(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for link in self.links:
            seen.setdefault(link.a)
            seen.setdefault(link.b)
        return tuple(seen)

    def link(self, a: str, b: str) -> Link:
        for link in self.links:
            if link.pair == {a, b}:
                return link
        raise ConfigError(f"{self.path}: no [[link]] between {a!r} and {b!r}; add one with a, b and latency_ms")

    def check_regions(self, regions: Iterable[str]) -> tuple[str, ...]:
        """The regions, validated: known to the matrix, no duplicates, a link for every pair."""
        names = tuple(regions)
        if len(names) < 2:
            raise ConfigError(f"{self.path}: a rehearsal needs at least two regions, got {', '.join(names) or 'none'}")
        if len(set(names)) != len(names):
            raise ConfigError(f"{self.path}: regions repeat: {', '.join(names)}")
        known = set(self.regions)
        for r in names:
            if r not in known:
                raise ConfigError(f"{self.path}: region {r!r} has no [[link]] in the matrix (it has {', '.join(self.regions)})")
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                self.link(a, b)
        return names


def load_matrix(path: str | Path) -> WanMatrix:
    return parse_matrix(tomlfile.read_text(path, "WAN matrix"), source=str(Path(path)))


def parse_matrix(text: str, source: str = "matrix") -> WanMatrix:
    doc = tomlfile.loads(text, source)

    def fail(index: int | None, key: str, msg: str) -> ConfigError:
        line = _line_of(text, index, key.rsplit(".", 1)[-1])
        where = f"{source}:{line}" if line else source
        return ConfigError(f"{where}: {key}: {msg}")

    def num(index: int, pre: str, key: str, v: Any, high: float, *, low_open: bool) -> float:
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 or (v == 0 and not low_open))
        if not ok or v > high:
            raise fail(index, pre + key, f"must be a number {'>' if low_open else '>='} 0 and <= {high:g}, got {v!r}")
        return float(v)

    for k in doc:
        if k != "link":
            raise fail(None, k, "unknown key (a matrix holds only [[link]] tables)")
    raw = doc.get("link")
    if raw is None:
        raise fail(None, "link", "the matrix has no links; add [[link]] tables with a, b and latency_ms")
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise fail(None, "link", "must be an array of tables ([[link]])")
    links: list[Link] = []
    seen: dict[frozenset[str], int] = {}
    for i, t in enumerate(raw):
        pre = f"link[{i}]."
        for k in t:
            if k not in _LINK_KEYS:
                raise fail(i, pre + k, f"unknown key (allowed: {', '.join(sorted(_LINK_KEYS))})")
        ends = []
        for k in ("a", "b"):
            v = t.get(k)
            if v is None:
                raise fail(i, pre + k, "missing; a link names its two regions as a and b")
            if not is_region_name(v):
                raise fail(i, pre + k, region_name_problem(v))
            ends.append(v)
        if ends[0] == ends[1]:
            raise fail(i, pre + "b", f"a link joins two different regions, got {ends[0]!r} twice")
        pair = frozenset(ends)
        if pair in seen:
            raise fail(i, pre + "b", f"{ends[0]} and {ends[1]} already have a link (link[{seen[pair]}])")
        seen[pair] = i
        if "latency_ms" not in t:
            raise fail(i, pre + "latency_ms", "missing; the one-way latency in milliseconds")
        latency = num(i, pre, "latency_ms", t["latency_ms"], MAX_LATENCY_MS, low_open=False)
        bw = t.get("bandwidth_mbit")
        bandwidth = None if bw is None else num(i, pre, "bandwidth_mbit", bw, 1e6, low_open=True)
        queue = num(i, pre, "queue_ms", t.get("queue_ms", DEFAULT_QUEUE_MS), 60_000.0, low_open=True)
        links.append(Link(a=ends[0], b=ends[1], latency_ms=latency, bandwidth_mbit=bandwidth, queue_ms=queue))
    return WanMatrix(links=tuple(links), path=source)


def _line_of(text: str, index: int | None, leaf: str) -> int | None:
    """The line of ``leaf`` inside the index-th [[link]] table (or of that table's header)."""
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\[\s*link\s*\]\]")
    key = re.compile(r'^\s*"?' + re.escape(leaf) + r'"?\s*=')
    if index is None:
        for n, line in enumerate(lines):
            if key.match(line) or header.match(line):
                return n + 1
        return None
    seen = -1
    for n, line in enumerate(lines):
        if header.match(line):
            seen += 1
            if seen == index:
                for m in range(n + 1, len(lines)):
                    if lines[m].lstrip().startswith("["):
                        break
                    if key.match(lines[m]):
                        return m + 1
                return n + 1
    return None


def format_matrix(links: Iterable[Link], comment: str | None = None) -> str:
    """TOML text for ``links``, in the format :func:`parse_matrix` reads."""
    out = [f"# {c}" for c in comment.splitlines()] if comment else []
    for link in links:
        if out:
            out.append("")
        out += ["[[link]]", f'a = "{link.a}"', f'b = "{link.b}"', f"latency_ms = {_fmt(link.latency_ms)}  # one way"]
        if link.bandwidth_mbit is not None:
            out.append(f"bandwidth_mbit = {_fmt(link.bandwidth_mbit)}")
        if link.queue_ms != DEFAULT_QUEUE_MS:
            out.append(f"queue_ms = {_fmt(link.queue_ms)}")
    return "\n".join(out) + "\n"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.3f}".rstrip("0")


def matrix_from_rtts(
    rtts_ms: Mapping[tuple[str, str], float], bandwidth_mbit: Mapping[tuple[str, str], float] | None = None
) -> tuple[Link, ...]:
    """Links from measured round trips: one-way latency is half the RTT (links are symmetric)."""
    links: dict[frozenset[str], Link] = {}
    for (a, b), rtt in rtts_ms.items():
        if a == b or frozenset((a, b)) in links:
            continue
        bw = None if bandwidth_mbit is None else bandwidth_mbit.get((a, b), bandwidth_mbit.get((b, a)))
        links[frozenset((a, b))] = Link(a=a, b=b, latency_ms=round(rtt / 2, 3), bandwidth_mbit=bw)
    return tuple(links.values())


def update_matrix(path: str | Path, origin: str | None, rtts_ms: Mapping[str, float], comment: str | None = None) -> tuple[Link, ...]:
    """Set the links from ``origin`` (this host's region) to each region of ``rtts_ms`` (round trips
    in ms measured from here) in the matrix file at ``path``, keeping its other links and the caps
    and buffers of the links it updates. Run on one host per region, this fills the whole matrix.
    Returns the links it set."""
    p = Path(path)
    if not origin:
        raise ConfigError(f"{p}: this host's region is unknown; set GEOSHARD_REGION (or AWS_REGION) to the region it runs in")
    check_region_name(origin, f"{p}: this host's region")
    measured = {r: rtt for r, rtt in rtts_ms.items() if r != origin and rtt > 0}
    if not measured:
        raise ConfigError(f"{p}: no region other than {origin} was measured; nothing to write")
    existing = list(load_matrix(p).links) if p.exists() else []
    fresh: list[Link] = []
    for region, rtt in measured.items():
        old = next((x for x in existing if x.pair == {origin, region}), None)
        link = Link(
            a=origin,
            b=region,
            latency_ms=round(rtt / 2, 3),
            bandwidth_mbit=old.bandwidth_mbit if old else None,
            queue_ms=old.queue_ms if old else DEFAULT_QUEUE_MS,
        )
        if old is not None:
            existing[existing.index(old)] = link
        else:
            existing.append(link)
        fresh.append(link)
    write_matrix(p, existing, comment)
    return tuple(fresh)


def write_matrix(path: str | Path, links: Iterable[Link], comment: str | None = None) -> Path:
    """Write ``links`` as a matrix file atomically (temporary file, then rename); validated first."""
    p = Path(path)
    text = format_matrix(tuple(links), comment)
    parse_matrix(text, source=str(p))  # what we write must load
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"{p}: cannot write WAN matrix: {e.strerror or e}") from e
    return p
