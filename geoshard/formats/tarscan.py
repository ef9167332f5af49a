"""The vectorized tar scanner's old import path: it lives in :mod:`geoshard.formats.wds.tarscan`."""

from __future__ import annotations

from geoshard.formats.wds.tarscan import Members, ScanResult, scan

__all__ = ["Members", "ScanResult", "scan"]
