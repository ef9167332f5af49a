"""Naming the file a user passed as ``--plan`` by mistake (a WAN matrix, a JSON manifest), so the
error says what the file is instead of a key or a TOML position inside it."""

from __future__ import annotations

import json
import re

from geoshard.errors import ConfigError

# A WAN matrix is a list of [[link]] tables and nothing else a plan has.
_LINK_TABLE = re.compile(r"^\s*\[\[\s*link\s*\]\]", re.MULTILINE)
_PLAN_TABLE = re.compile(r"^\s*\[\s*(regions|routing|shards|egress)\b", re.MULTILINE)


def refuse_other_files(text: str, source: str) -> None:
    """Raise a ConfigError naming what ``text`` is when it is a WAN matrix or JSON, not a plan."""
    if _LINK_TABLE.search(text) and not _PLAN_TABLE.search(text):
        raise ConfigError(f"{source}: looks like a WAN matrix ([[link]] tables), not a plan; pass it with --wan")
    if not text.lstrip().startswith(("{", "[")):
        return
    try:
        doc = json.loads(text)
    except ValueError:
        return  # a TOML table header such as [regions.x]: the TOML reader words its own errors
    if isinstance(doc, dict) and "generation" in doc and ("regions" in doc or "shards" in doc):
        raise ConfigError(f"{source}: is a JSON manifest written by geoshard split, not a TOML plan; pass the plan the split was made with")
    raise ConfigError(f"{source}: is JSON, not a TOML plan")
