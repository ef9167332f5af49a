"""The record of DiLoCo's rounds: what ``DiLoCo.maybe_sync`` returns, and each line of a region
leader's ``RUN_DIR/rounds-<region>.jsonl`` (a join or a round), with its one writer (``append``)
and its one reader (``read_rounds``).

Version 1 is the files written before the version field (read the same way); 2 adds the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoshard.errors import DataError
from geoshard.plan.names import REGION_NAME

VERSION = 2
EVENTS = ("join", "round")
_ROUNDS_FILE = re.compile(rf"^rounds-({REGION_NAME.pattern})\.jsonl$")  # the one region-name rule
# The keys of each event's line, in the order they are written (between region, job, event and steps_lost).
_JOIN_KEYS: tuple[str, ...] = ("round", "step", "created", "bytes_read")
_ROUND_KEYS: tuple[str, ...] = ("round", "step", "regions", "missing", "sync_s", "bytes_published", "bytes_read", "compression")
_ROUND_KEYS += ("adopted", "exchange_s", "applied_step")


@dataclass(frozen=True)
class RoundRecord:
    round: int
    step: int  # the region's inner step count at the round (or at its join)
    regions: tuple[str, ...] = ()  # whose pseudo-gradients were averaged
    missing: tuple[str, ...] = ()  # regions of the job that were not (those that finished their steps are not missing)
    sync_s: float = 0.0  # from publishing to the new parameters in place, on this region
    bytes_published: int = 0  # by this region's leader: pseudo-gradient, and the state when it closed the round
    bytes_read: int = 0  # by this region's leader: the other regions' pseudo-gradients (or the state it adopted)
    compression: str = ""
    adopted: bool = False  # this region missed the close and took the round's published state
    exchange_s: float = 0.0  # the exchange itself (with overlap it runs behind training; sync_s is what training waited)
    applied_step: int = 0  # the inner step at which the region took the round's result (step + overlap)
    # What the training loop adds to the line it writes:
    event: str = "round"  # or "join": the region starts from the published state of ``round``
    region: str = ""
    job: str | None = None  # one launch of the job: round numbers start again when a whole job is resumed
    steps_lost: int = 0  # inner steps whose work never reached the outer parameters
    created: bool = False  # a join: this region published round 0 (a fresh job)
    # Written only when there are any (lines stay as they were otherwise):
    refused: int = 0  # values this leader refused from the store (unsigned, malformed, non-finite) since its last line
    left_out: tuple[tuple[str, str], ...] = ()  # (region, why): members whose pseudo-gradient the round left out
    # Written by the peer-to-peer transport only (lines of the store transport stay as they were):
    transport: str = ""  # "p2p": pseudo-gradients over gloo between the regions' ranks
    store_bytes: int = 0  # bytes this rank's store client carried for the round (membership, rendezvous, MACs)
    phases: tuple[tuple[str, float], ...] = ()  # (phase, seconds) of this rank's exchange: where the time went
    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        body = {k: getattr(self, k) for k in (_JOIN_KEYS if self.event == "join" else _ROUND_KEYS)}
        body = {k: list(v) if isinstance(v, tuple) else v for k, v in body.items()}
        doc = {"version": self.version, "region": self.region, "job": self.job, "event": self.event, **body, "steps_lost": self.steps_lost}
        if self.refused:
            doc["refused"] = self.refused
        if self.left_out:
            doc["left_out"] = dict(self.left_out)
        if self.transport:
            doc["transport"] = self.transport
            doc["store_bytes"] = self.store_bytes
            if self.phases:
                doc["phases"] = {k: round(v, 4) for k, v in self.phases}
        return doc

    @classmethod
    def from_dict(cls, doc: Any) -> RoundRecord:
        """ValueError saying what is wrong; a line without a version is version 1."""
        if not isinstance(doc, dict) or doc.get("event") not in EVENTS or not isinstance(doc.get("region"), str):
            raise ValueError("expected a join or round record with its region")
        for key in ("round", "step", "steps_lost"):
            if not isinstance(doc.get(key, 0), int) or doc.get(key, 0) < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {doc.get(key)!r}")
        version = doc.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
            raise ValueError(f"version {version!r} is not one this geoshard reads (1 to {VERSION}); use the geoshard that wrote it")
        job = doc.get("job")
        return cls(
            round=doc.get("round", 0),
            step=doc.get("step", 0),
            regions=tuple(doc.get("regions") or ()),
            missing=tuple(doc.get("missing") or ()),
            sync_s=_float(doc.get("sync_s", 0.0)),
            bytes_published=_count(doc, "bytes_published"),
            bytes_read=_count(doc, "bytes_read"),
            compression=str(doc.get("compression", "")),
            adopted=bool(doc.get("adopted")),
            exchange_s=_float(doc.get("exchange_s", 0.0)),
            applied_step=_count(doc, "applied_step"),
            event=doc["event"],
            region=doc["region"],
            job=None if job is None else str(job),
            steps_lost=doc.get("steps_lost", 0),
            created=bool(doc.get("created")),
            refused=_count(doc, "refused"),
            left_out=_left_out(doc.get("left_out")),
            transport=str(doc.get("transport", "")),
            store_bytes=_count(doc, "store_bytes"),
            phases=_phases(doc.get("phases")),
            version=version,
        )


@dataclass(frozen=True)
class JoinRecord:
    """What ``DiLoCo.join`` returns."""

    round: int  # the round whose state the region starts from
    step: int  # the inner step count of the region that published it
    created: bool  # this region published round 0 (a fresh job)
    bytes_read: int
    refused: int = 0  # values refused from the store while joining


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0  # a time that is not a number counts as none


def _count(doc: dict[str, Any], key: str) -> int:
    try:
        return int(doc.get(key, 0))
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer, got {doc.get(key)!r}") from None


def _left_out(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError(f"left_out must map regions to reasons, got {value!r}")
    return tuple((str(k), str(v)) for k, v in value.items())


def _phases(value: Any) -> tuple[tuple[str, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError(f"phases must map phases to seconds, got {value!r}")
    return tuple((str(k), _float(v)) for k, v in value.items())


def rounds_path(out: Path, region: str) -> Path:
    return out / f"rounds-{region}.jsonl"


def append(path: Path, rec: RoundRecord) -> None:
    """One line; append-only and flushed per line, so a killed region keeps its history."""
    with open(path, "a") as f:
        f.write(json.dumps(rec.to_dict()) + "\n")


def read_rounds(run_dir: Path) -> list[RoundRecord]:
    """Every line of every region's rounds file; DataError naming file and line when one is wrong.
    A last line cut off mid-write (a killed leader) is skipped."""
    out: list[RoundRecord] = []
    for path in sorted(p for p in run_dir.glob("rounds-*.jsonl") if _ROUNDS_FILE.match(p.name)):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for lineno, line in enumerate(lines, 1):
            try:
                doc = json.loads(line)
            except ValueError:
                if lineno == len(lines):
                    continue
                raise DataError(f"{path}:{lineno}: not a JSON record") from None
            try:
                out.append(RoundRecord.from_dict(doc))
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: {e}") from None
    return out
