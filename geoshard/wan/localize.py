"""A plan for a rehearsal: each region's loopback S3 endpoint (a server on this host) is served
from that region's namespace (``Rehearsal.expose``), so every region's bucket lives in its region:
its own ranks reach it without crossing a link, other regions' ranks through the forwarder."""

from __future__ import annotations

import re
from collections.abc import Callable

from geoshard.plan.names import REGION_NAME

_REGION_TABLE = re.compile(r'^\s*\[regions\.("?)(' + REGION_NAME.pattern + r")\1\]")
_LOOPBACK_ENDPOINT = re.compile(r'^(\s*endpoint\s*=\s*")http://(?:127\.0\.0\.1|localhost):(\d+)(/?")')

Expose = Callable[[str, int], tuple[str, int]]  # (region, host port) -> (address, port) in the region


def localize_endpoints(text: str, expose: Expose) -> str:
    """The plan's text with each region's loopback endpoint replaced by its exposed address;
    endpoints elsewhere, and everything else, are left as they are."""
    out, region = [], None
    for line in text.splitlines(keepends=True):
        if m := _REGION_TABLE.match(line):
            region = m.group(2)
        elif line.lstrip().startswith("["):
            region = None
        elif region is not None and (m := _LOOPBACK_ENDPOINT.match(line)):
            address, port = expose(region, int(m.group(2)))
            line = f"{m.group(1)}http://{address}:{port}{m.group(3)}{line[m.end() :]}"
        out.append(line)
    return "".join(out)
