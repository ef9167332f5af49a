"""Elastic resume: an interrupted epoch continued on another number of ranks in a region (or with
a region added or removed), with no sample of it read twice and none left out beyond a remainder
smaller than the region's new rank count.

An epoch's order is defined without the rank count: the region's canonical sequence
(``epoch.epoch_sequence``: its shards permuted with ``(seed, epoch)``, less the block the epoch
leaves out). The ranks that start the epoch cut it into contiguous ranges and their workers' runs
(``epoch.py``); what each logical worker consumed is a prefix of its own stream, so a **segment**
(the ranks, workers and samples per rank that read part of an epoch, and those per-worker counts)
says exactly which positions of the sequence were read, without listing a sample. A resume on
another world takes the sequence less those positions, in canonical order, and re-stripes it over
the new ranks as the epoch's next segment: ``even_share`` of it per rank, so with ``drop`` fewer
than the new rank count are left out (and with ``pad`` as many read twice). A further resume in
the same epoch repeats the step over the segments so far. After the epoch, the job's own plan
takes over again.

A segment's counts are one row when every rank of the region consumed alike (ranks in lockstep,
as under DDP), so a region's state stays a few hundred bytes whatever its rank count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from geoshard.errors import ConfigError
from geoshard.loaders.balance import even_share
from geoshard.loaders.epoch import EpochSequence, Layout, RankPlan, epoch_sequence, per_rank, rank_plan, worker_order


@dataclass(frozen=True)
class Segment:
    """Part of an epoch read by one world: ``ranks`` of the region with ``workers`` logical workers
    each, ``per`` samples per rank, and per rank and worker the samples of its stream consumed
    (a single row: every rank consumed alike)."""

    ranks: int
    workers: int
    per: int
    consumed: tuple[tuple[int, ...], ...]

    def row(self, rank: int) -> tuple[int, ...]:
        return self.consumed[0] if len(self.consumed) == 1 else self.consumed[rank]

    def to_json(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "workers": self.workers, "per": self.per, "consumed": [list(r) for r in self.consumed]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Segment:
        try:
            seg = cls(int(d["ranks"]), int(d["workers"]), int(d["per"]), tuple(tuple(int(c) for c in r) for r in d["consumed"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"loader state: a malformed segment {str(d)[:200]}") from e
        seg.check()
        return seg

    def check(self) -> None:
        rows_ok = len(self.consumed) in (1, self.ranks) and all(len(r) == self.workers for r in self.consumed)
        if min(self.ranks, self.workers) < 1 or self.per < 0 or not rows_ok or any(c < 0 for r in self.consumed for c in r):
            raise ConfigError(f"loader state: a malformed segment ({self.ranks} ranks, {self.workers} workers, per {self.per})")


def rest_of_epoch(counts: Sequence[int], epoch: int, layout: Layout, segments: Sequence[Segment]) -> EpochSequence:
    """The epoch's samples that ``segments`` left unread, in canonical order."""
    first = segments[0]
    seq = epoch_sequence(counts, epoch, dataclasses.replace(layout, rank=0, world_size=first.ranks, samples_per_rank=first.per))
    for seg in segments:
        read = np.zeros(len(seq.ids), dtype=bool)
        for rank in range(seg.ranks):
            pos = seq.positions(rank, seg.per)
            lay = dataclasses.replace(layout, rank=rank, world_size=seg.ranks, num_workers=seg.workers, samples_per_rank=seg.per)
            for worker, taken in enumerate(seg.row(rank)):
                order = worker_order(len(pos), worker, lay, epoch)
                if taken > len(order):
                    raise ConfigError(f"loader state: worker {worker} of rank {rank} consumed {taken} of its {len(order)} samples")
                read[pos[order[:taken]]] = True
        seq = EpochSequence(seq.ids[~read], seq.starts, seq.dropped, seq.padded)
    return seq


def epoch_plan(counts: Sequence[int], epoch: int, layout: Layout, segments: Sequence[Segment] = ()) -> RankPlan:
    """This rank's plan for the epoch: the job's own, or after ``segments`` its stripe of the rest."""
    if not segments:
        return rank_plan(counts, epoch, layout)
    rest = rest_of_epoch(counts, epoch, layout, segments)
    return rest.rank_plan(layout.rank, even_share(len(rest.ids), layout.world_size, layout.remainder))


def epoch_per(counts: Sequence[int], epoch: int, layout: Layout, segments: Sequence[Segment] = ()) -> int:
    """Samples each rank of the region yields in the epoch (after ``segments``: in its next segment)."""
    if not segments:
        return per_rank(int(sum(counts)), layout)
    return even_share(len(rest_of_epoch(counts, epoch, layout, segments).ids), layout.world_size, layout.remainder)


def region_states(states: Iterable[Mapping[str, Any]], region: str) -> dict[str, Any]:
    """What ``RegionalDataset.load_state_dict`` takes to resume a rank of ``region`` on any number
    of ranks: every saved rank's state of the region (e.g. a checkpoint's loader states), and the
    lowest saved epoch, where a region added to the job begins."""
    saved = list(states)
    epochs = [int(s["epoch"]) for s in saved if isinstance(s, Mapping) and "epoch" in s]
    mine = sorted((s for s in saved if isinstance(s, Mapping) and s.get("region") == region), key=lambda s: int(s["region_rank"]))
    return {"region": region, "epoch": min(epochs, default=0), "ranks": mine}


def own_state(state: Mapping[str, Any], region_rank: int) -> Mapping[str, Any] | None:
    """The saved state of this rank (by its rank in the region) in ``state``: a rank's own state,
    or ``region_states``' (there, the first one when this rank has none: the fields every rank of a
    region saves alike are checked on it). None: the region saved none."""
    ranks = _saved(state)
    return next((s for s in ranks if s.get("region_rank") == region_rank), ranks[0] if ranks else None)


@dataclass(frozen=True)
class ResumePoint:
    """Where a loaded state makes the next iteration begin: in the epoch's current segment at a
    saved position (``consumed``), or (``consumed`` None) at the start of a new one after ``segments``."""

    epoch: int
    consumed: list[int] | None
    next_worker: int
    segments: tuple[Segment, ...]
    note: str = ""  # what an elastic resume did, for the log


def saved_segments(state: Mapping[str, Any]) -> tuple[Segment, ...]:
    return tuple(Segment.from_json(s) for s in state.get("segments") or ())


def resume_point(state: Mapping[str, Any], counts: Sequence[int], layout: Layout) -> ResumePoint:
    """Where this rank (``layout``) continues from ``state`` (its own, or ``region_states``'): as
    saved when the region's ranks and samples per rank are the ones saved, else re-striped."""
    ranks = _saved(state)
    if not ranks:
        epoch = int(state.get("epoch", 0))
        return ResumePoint(epoch, None, 0, (), f"no saved position for this region: it begins epoch {epoch}")
    own = next((s for s in ranks if s.get("region_rank") == layout.rank), None)
    if own is not None:
        segs = saved_segments(own)
        per = epoch_per(counts, int(own["epoch"]), layout, segs)
        if own.get("region_size") == layout.world_size and own.get("samples_per_rank") == per:
            return ResumePoint(int(own["epoch"]), [int(c) for c in own["consumed"]], int(own["next_worker"]), segs)
    seg, epoch, earlier = _segment_of(ranks)
    segments = (*earlier, seg) if any(c for r in seg.consumed for c in r) else earlier
    if not segments:
        return ResumePoint(epoch, None, 0, (), f"epoch {epoch} had not begun: it begins on {layout.world_size} rank(s) of the region")
    rest = len(rest_of_epoch(counts, epoch, layout, segments).ids)
    per = even_share(rest, layout.world_size, layout.remainder)
    note = (
        f"epoch {epoch} resumes on {layout.world_size} rank(s) of the region (saved on {seg.ranks}): "
        f"{rest} samples left, {per} per rank, {max(0, rest - per * layout.world_size)} left out, "
        f"{max(0, per * layout.world_size - rest)} read twice"
    )
    return ResumePoint(epoch, None, 0, segments, note)


def _saved(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The saved rank states in ``state``: ``region_states``' list, or the one it is."""
    return list(state.get("ranks", [state]))


def _segment_of(ranks: Sequence[Mapping[str, Any]]) -> tuple[Segment, int, tuple[Segment, ...]]:
    """The segment the region's saved states describe, their epoch and the epoch's earlier
    segments; refused unless they are every rank of one world at one point of one epoch."""
    first = ranks[0]
    size = int(first["region_size"])
    same = ("epoch", "region_size", "samples_per_rank", "num_workers", "segments")
    odd = [k for k in same for s in ranks if s.get(k) != first.get(k)]
    have = sorted(int(s["region_rank"]) for s in ranks)
    if odd or have != list(range(size)):
        missing = sorted(set(range(size)) - set(have))
        why = f"they differ in {odd[0]}" if odd else f"rank(s) {missing} of its {size} are missing"
        raise ConfigError(
            f"loader state of {first.get('region')}: to resume on another number of ranks, pass the states of all "
            f"the region's saved ranks (region_states); {why}"
        )
    rows = [tuple(int(c) for c in s["consumed"]) for s in ranks]
    seg = Segment(size, int(first["num_workers"]), int(first["samples_per_rank"]), (rows[0],) if len(set(rows)) == 1 else tuple(rows))
    seg.check()
    return seg, int(first["epoch"]), saved_segments(first)
