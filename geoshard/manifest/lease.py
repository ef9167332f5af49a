"""Leases: what a running or resumable job reads stays readable (docs/guarantees.md section 11).

A job that reads a region's bucket writes ``_geoshard/leases/<job>.json`` there, naming the
generations it reads and when the lease expires; it renews the lease while it runs.
``geoshard sync --delete`` (and ``refresh --delete``) keeps every shard and history manifest of a
generation an unexpired lease names. The loaders write leases, sync reads them: the record lives
here, beside the manifests both already share.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from geoshard.errors import DataError
from geoshard.manifest import checks

LEASES = "_geoshard/leases"  # a region bucket's leases, one object per job
HISTORY = "_geoshard/manifests"  # a region bucket's manifest of every kept generation
LEASE_VERSION = 1
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def history_path(generation: int) -> str:
    """Where a bucket keeps the region manifest of ``generation`` (written by sync before ``manifest.json``)."""
    return f"{HISTORY}/{generation:08d}.json"


def lease_path(job: str) -> str:
    return f"{LEASES}/{check_job(job)}.json"


def check_job(job: str) -> str:
    """A job name is one plain object name: letters, digits, '.', '_' and '-'."""
    if not _JOB.match(job):
        raise DataError(f"lease job name {job!r}: use 1-128 letters, digits, '.', '_' or '-' (it names an object in the bucket)")
    return job


@dataclass(frozen=True)
class Lease:
    """One job's hold on generations of one region's bucket until ``expires`` (Unix seconds, UTC)."""

    job: str
    region: str
    generations: tuple[int, ...]
    expires: float

    def live(self, now: float) -> bool:
        return self.expires > now

    def to_json(self) -> bytes:
        doc = {"version": LEASE_VERSION, "job": self.job, "region": self.region, "expires": self.expires}
        doc["generations"] = list(self.generations)
        return (json.dumps(doc, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, name: str) -> Lease:
        d = checks.mapping(checks.parse(data, name), "the lease", name)
        try:
            expires = float(d["expires"])
            return cls(
                job=check_job(str(d["job"])),
                region=str(d["region"]),
                generations=tuple(checks.count(g, "generations", name) for g in checks.listing(d["generations"], "generations", name)),
                expires=expires,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{name}: not a geoshard lease (missing or invalid {e})") from e
