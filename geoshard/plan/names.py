"""The one region-name rule: the plan, ``--regions``, the WAN matrix and the run files all use it.

Region names become folder names, object-key prefixes and parts of file names
(``rounds-<region>.jsonl``), so they are kept to characters that are plain in all of them.
"""

from __future__ import annotations

import re

from geoshard.errors import ConfigError

REGION_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
RULE = "lowercase letters, digits, '.', '_' and '-', starting with a letter or digit, at most 63 characters"


def is_region_name(name: object) -> bool:
    return isinstance(name, str) and REGION_NAME.fullmatch(name) is not None


def region_name_problem(name: object) -> str:
    """What to say after the key when ``name`` is not a region name."""
    return f"must be a region name ({RULE}), got {name!r}"


def check_region_name(name: object, where: str) -> str:
    """``name`` if it is a region name, else a ConfigError naming ``where`` (the key or option)."""
    if not isinstance(name, str) or not is_region_name(name):
        raise ConfigError(f"{where}: {region_name_problem(name)}")
    return name
