"""The data's generation agreed across DiLoCo's regions (docs/guarantees.md section 11).

Under ``--sync diloco`` each region is a torchrun world of its own, so the loader's all-gather
(loaders/generation.py ``agree``) spans one region. The region leaders agree through the job's
outer store instead, every value signed with the job's secret, without waiting for each other's
epoch boundaries (they are not aligned):

- ``gen/report/<region>``: the newest generation the region's bucket publishes, set by its leader
  at each decision, never lower than before (``none``: a region without a bucket has no say);
- ``gen/from/<g>``: the epoch from which every region reads generation ``g``. The first leader to
  see every region report ``g`` or newer sets it (``compare_set``: one value for the job), one
  epoch after the one it is deciding, so a region up to an epoch ahead has not decided it yet.

An epoch reads the newest generation announced for it or before. At the start (no epoch) every
leader waits, with a bound, for every region's first report and pins their least: the regions
start together. A value that is not signed by the job's secret or not a number is refused: it
counts as missing (no move), and the first of each kind is named in a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from geoshard.errors import ConfigError
from geoshard.trainer.config import TrainConfig, parse_host_port
from geoshard.trainer.diloco.auth import Refused, Signer, read_secret
from geoshard.trainer.diloco.kv import KV, connect_store

log = logging.getLogger(__name__)
PREFIX = "gen"
LEAD_EPOCHS = 1  # an announced generation starts this many epochs after the announcer's decision
NO_BUCKET = "none"


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's outer store is and the file of its secret (read when the leader connects)."""

    host: str
    port: int
    secret_file: str
    timeout_s: float


@dataclass
class RegionGenerations:
    """The ``Topology.regions_agree`` of a DiLoCo region: called on its leader only, which connects
    to the store at its first call (the other ranks never do)."""

    region: str
    regions: tuple[str, ...]
    address: StoreAddress | None = None
    start_timeout_s: float = 300.0
    kv: KV | None = field(default=None, repr=False)
    reported: int = 0  # the highest generation this leader reported; -1: it said it has no bucket
    reading: int = 0  # the generation this region reads now (its pin, then each move)
    _late: set[int] = field(default_factory=set, repr=False)

    @classmethod
    def for_job(cls, cfg: TrainConfig, region: str) -> RegionGenerations:
        """The region's agreement on the job's outer store (``geoshard train --regions`` sets it up)."""
        if not cfg.outer_store or not cfg.outer_secret_file:
            raise ConfigError("--sync diloco needs --outer-store and --outer-secret-file (geoshard train --regions sets both)")
        host, port = parse_host_port(cfg.outer_store, "--outer-store")
        address = StoreAddress(host, port, cfg.outer_secret_file, cfg.outer_timeout)
        regions = tuple(r.region for r in cfg.job_regions)
        return cls(region, regions, address, start_timeout_s=max(300.0, cfg.outer_timeout))

    def __call__(self, newest: int | None, epoch: int | None) -> int | None:
        kv = self._kv()
        self._report(kv, newest)
        if epoch is None:
            pinned = self._pin(kv, newest)
            self.reading = pinned or 0
            return pinned
        reports = self._reports(kv)
        common = _least(reports) if all(r is not None for r in reports.values()) else None
        if common is not None and common > self.reading:
            self._announce(kv, common, epoch + LEAD_EPOCHS)
        top = max((g for g in reports.values() if g), default=0)
        starts = self._starts(kv, range(self.reading + 1, top + 1))
        due = [g for g, e in starts.items() if e <= epoch]
        if due:
            g = max(due)
            if starts[g] < epoch and g not in self._late:
                self._late.add(g)
                log.warning(
                    "DiLoCo: region %s reads generation %d from epoch %d; the job announced it from epoch %d, which this "
                    "region had decided already (it ran more than %d epoch(s) ahead of the region that announced it, or resumed)",
                    self.region,
                    g,
                    epoch,
                    starts[g],
                    LEAD_EPOCHS,
                )
            self.reading = g
        return self.reading or None

    def _kv(self) -> KV:
        if self.kv is None:
            if self.address is None:
                raise RuntimeError("RegionGenerations needs a store address or a KV")
            a = self.address
            self.kv = KV(connect_store(a.host, a.port, a.timeout_s), PREFIX, Signer(read_secret(a.secret_file)))
        if self.reported == 0:  # a restarted region goes on from what its last leader reported
            key = self.kv.key("report", self.region)
            raw = self.kv.get(key)
            self.reported = (_number(self.kv, key, raw, NO_BUCKET) or 0) if raw is not None else 0
        return self.kv

    def _report(self, kv: KV, newest: int | None) -> None:
        if newest is None:
            if self.reported == 0:
                kv.set(kv.key("report", self.region), NO_BUCKET)
                self.reported = -1
        elif newest > self.reported:  # monotone: a bucket read older later (a stale endpoint) takes nothing back
            kv.set(kv.key("report", self.region), str(newest))
            self.reported = newest

    def _pin(self, kv: KV, newest: int | None) -> int | None:
        keys = [kv.key("report", r) for r in self.regions]
        if not kv.wait_all(keys, self.start_timeout_s):
            silent = [r for r, k in zip(self.regions, keys, strict=True) if not kv.store.check([k])]
            log.warning(
                "DiLoCo: region %s pins the newest generation the regions that answered have published: %s said nothing "
                "within %g s; later epochs move only once every region has reported",
                self.region,
                ", ".join(silent),
                self.start_timeout_s,
            )
        reports = self._reports(kv)
        if self.reported > 0:
            reports[self.region] = self.reported  # this region's own figure needs no store
        return _least(reports)

    def _reports(self, kv: KV) -> dict[str, int | None]:
        """Each region's report: its generation, 0 for no bucket (no say), None when missing or refused."""
        keys = [kv.key("report", r) for r in self.regions]
        # Once every region has reported (the usual case): two round trips, whatever the number of regions.
        raws = kv.open_many(keys) if kv.store.check(keys) else [kv.get(k) for k in keys]
        return {r: None if raw is None else _number(kv, k, raw, NO_BUCKET) for r, k, raw in zip(self.regions, keys, raws, strict=True)}

    def _announce(self, kv: KV, generation: int, epoch: int) -> None:
        key = kv.key("from", generation)
        signed = kv.signer.sign(key, str(epoch).encode())
        compare_set: Any = getattr(kv.store, "compare_set", None)
        if compare_set is not None:
            compare_set(key, b"", signed)  # set only where no leader announced it first
        elif not kv.store.check([key]):
            kv.store.set(key, signed)

    def _starts(self, kv: KV, generations: range) -> dict[int, int]:
        """The announced start epoch of each of ``generations`` that has one (and is not refused)."""
        out: dict[int, int] = {}
        for g in generations:
            key = kv.key("from", g)
            raw = kv.get(key)
            start = None if raw is None else _number(kv, key, raw, None, least=0)
            if start is not None:
                out[g] = start
        return out


def _number(kv: KV, key: str, payload: bytes, nothing: str | None, least: int = 1) -> int | None:
    """A signed payload's number (``least`` or more); 0 for ``nothing``; None, counted and named
    once, when it is neither."""
    text = payload.decode("ascii", errors="replace").strip()
    if nothing is not None and text == nothing:
        return 0
    if text.isdigit() and int(text) >= least:
        return int(text)
    kv.signer.refuse(key, Refused("malformed", f"{text[:40]!r} is not a number of at least {least}"), payload)
    return None


def _least(reports: dict[str, int | None]) -> int | None:
    """The least generation the regions with a say reported; None when none has."""
    known = [g for g in reports.values() if g]
    return min(known) if known else None
