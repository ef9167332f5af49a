"""Reading a TOML configuration file (the plan, the WAN matrix) with one-line errors naming it."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError


def read_text(path: str | Path, what: str) -> str:
    """The file's text; a ConfigError naming it ("plan file not found", "cannot read plan: ...")."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: {what} file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read {what}: {e}") from e


def loads(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from e
