"""WAN rehearsal: regions as network namespaces behind a latency and bandwidth matrix (docs/wan.md)."""

from geoshard.wan.errors import NeedsRootError, WanError
from geoshard.wan.matrix import Link, WanMatrix, load_matrix, parse_matrix, write_matrix
from geoshard.wan.rehearsal import Ceiling, Rehearsal, require_root

__all__ = [
    "Ceiling",
    "Link",
    "NeedsRootError",
    "Rehearsal",
    "WanError",
    "WanMatrix",
    "load_matrix",
    "parse_matrix",
    "require_root",
    "write_matrix",
]
