"""The search: for each sync choice, each region's placement on its own, then one prediction of
the whole job; the cheapest candidate (egress USD per epoch) that meets the budgets wins.

Costs under ``TOLERANCE`` apart count as equal, and then the choice closer to synchronous
training wins (``SyncChoice.fidelity``): a larger H or a lossy compression is taken only for
what it saves. With no candidate inside the budgets, the one with the smallest sum of relative
shortfalls is proposed, and each budget it misses is said with its shortfall.

A region's placement must keep its IO wait inside the budget and start soon enough: the job's
first batch is the slowest region's, so a placement whose first batch alone would hold the whole
job under the utilization target (a shard fetched over a slow link before step one) is refused
like one that waits too long, however cheap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from geoshard.optimize.choices import TIERS, Placement, SyncChoice, sync_grid
from geoshard.optimize.inputs import OptimizeInputs
from geoshard.sim import Prediction, outer, predict
from geoshard.sim.config import RegionSpec, SimConfig
from geoshard.sim.cost import price

log = logging.getLogger(__name__)
TOLERANCE_USD, TOLERANCE_SHARE = 0.01, 0.01  # two costs closer than max($0.01, 1%) are the same cost


@dataclass(frozen=True)
class BudgetCheck:
    name: str  # io_wait | utilization | egress_usd
    limit: float
    predicted: float
    met: bool
    short_by: float  # how far past the limit, in the budget's unit (0 when met)

    @property
    def relative(self) -> float:
        return self.short_by / self.limit if self.limit > 0 else (0.0 if self.met else 1.0)

    def text(self) -> str:
        if self.name == "egress_usd":
            got, lim, by = f"${self.predicted:,.2f}", f"${self.limit:,.2f}", f"${self.short_by:,.2f}"
            return f"egress {got} per epoch {'<=' if self.met else '>'} {lim}" + ("" if self.met else f" (over by {by})")
        got, lim, by = f"{self.predicted:.1%}", f"{self.limit:.1%}", f"{self.short_by * 100:.1f} points"
        if self.name == "io_wait":
            return f"IO wait {got} {'<=' if self.met else '>'} {lim}" + ("" if self.met else f" (over by {by})")
        return f"utilization {got} {'>=' if self.met else '<'} {lim}" + ("" if self.met else f" (short by {by})")


@dataclass(frozen=True)
class Seen:
    """One region under one kind of placement, as that kind's prediction has it."""

    io_wait: float  # share after the first batch
    remote_bytes: float  # read from another region's bucket
    first_s: float  # its time to the first batch
    ceiling: float  # the job's utilization at most, were this region's first batch the job's


Row = tuple[Placement, Seen, float, str | None]  # a placement, its figures, its USD per epoch, why it was refused


@dataclass(frozen=True)
class RegionChoice:
    name: str
    ranks: int
    placement: Placement
    copy_usd: float  # the one copy into the region's own storage, per epoch (spread over --epochs)
    io_wait: float  # its IO wait share with this placement, as predicted when it was chosen
    reason: str
    options: tuple[Row, ...] = ()  # every placement it had, with its figures and USD per epoch


@dataclass(frozen=True)
class Candidate:
    sync: SyncChoice
    regions: tuple[RegionChoice, ...]
    prediction: Prediction
    checks: tuple[BudgetCheck, ...]

    @property
    def copy_usd(self) -> float:
        return sum(r.copy_usd for r in self.regions)

    @property
    def egress_usd(self) -> float:
        """USD per epoch: what the run moves across regions (gradients, rounds, reads) + copies."""
        return self.prediction.egress_usd_total + self.copy_usd

    @property
    def feasible(self) -> bool:
        return all(c.met for c in self.checks)

    @property
    def shortfall(self) -> float:
        return sum(c.relative for c in self.checks)

    def failing(self) -> str:
        return "; ".join(c.text() for c in self.checks if not c.met)


@dataclass(frozen=True)
class Proposal:
    chosen: Candidate
    weights: tuple[tuple[str, int], ...]
    weights_reason: str
    sync_reason: str
    alternatives: tuple[tuple[str, str], ...]  # (candidate, why it was not chosen)
    candidates: int
    predictions: int
    seconds: float
    found: tuple[Candidate, ...] = ()  # every candidate predicted, in the grid's order

    @property
    def feasible(self) -> bool:
        return self.chosen.feasible


def optimize(inputs: OptimizeInputs) -> Proposal:
    t0 = time.perf_counter()
    base = inputs.base
    grid = sync_grid(len(base.regions), base.steps, inputs.max_outer_steps)
    found: list[Candidate] = []
    calls = 0
    for choice in grid:
        cfg = choice.apply(base)
        regions, n = place_regions(inputs, cfg)
        found.append(_candidate(inputs, choice, regions, cfg))
        calls += n + 1
    chosen = _pick(found)
    log.debug("plan optimize: %d candidates, %d predictions", len(found), calls)
    return Proposal(
        chosen=chosen,
        weights=tuple((r.name, r.ranks) for r in base.regions),
        weights_reason=_weights_reason(inputs),
        sync_reason=_sync_reason(chosen, found, inputs),
        alternatives=_alternatives(chosen, found),
        candidates=len(found),
        predictions=calls,
        seconds=time.perf_counter() - t0,
        found=tuple(found),
    )


def _options(inputs: OptimizeInputs, region: str) -> list[Placement]:
    """What a region may do: its own bucket (when the plan has one, or there is no plan), a replica,
    Alluxio (when the plan names one), or reading the source region's bucket (not under residency;
    its shards then go under a sibling of the source's prefix, which the plan's bucket rule allows)."""
    plan = inputs.plan
    mine = plan.region(region) if plan is not None else None
    out = [Placement("s3")] if mine is None or mine.bucket else []
    out.append(Placement("local"))
    if mine is not None and mine.alluxio:
        out.append(Placement("alluxio"))
    source = plan.region(inputs.source_region) if plan is not None else None
    if region != inputs.source_region and not inputs.residency and source is not None and source.bucket and source.bucket_prefix:
        out.append(Placement("remote", inputs.source_region))
    return out


def _as_spec(spec: RegionSpec, p: Placement) -> RegionSpec:
    return replace(spec, tier="s3" if p.tier == "remote" else p.tier, data_region=p.data_region)


def place_regions(inputs: OptimizeInputs, cfg: SimConfig) -> tuple[tuple[RegionChoice, ...], int]:
    """Each region's placement under ``cfg``'s sync: one prediction per kind of placement with every
    region on it (a region's loader does not depend on another's tier), then a choice per region."""
    options = {r.name: _options(inputs, r.name) for r in cfg.regions}
    kinds = [t for t in (*TIERS, "remote") if any(p.tier == t for ps in options.values() for p in ps)]
    seen: dict[str, dict[str, Seen]] = {}  # kind -> region -> what its prediction says of the region
    for kind in kinds:
        specs = []
        for r in cfg.regions:
            mine = [p for p in options[r.name] if p.tier == kind]
            specs.append(_as_spec(r, mine[0]) if mine else replace(r, tier="s3", data_region=None))
        p = predict(replace(cfg, regions=tuple(specs)))
        ceilings = _ceilings(p, cfg)
        seen[kind] = {
            g.name: Seen(g.io_wait_share_after_first_batch, g.cross_region_data_bytes, g.time_to_first_batch_s, ceilings[g.name])
            for g in p.regions
        }
    chosen = tuple(_choose(inputs, r, options[r.name], seen, cfg) for r in cfg.regions)
    return chosen, len(kinds)


def _ceilings(p: Prediction, cfg: SimConfig) -> dict[str, float]:
    """Per region, the job's utilization were its first batch the job's and its IO wait the job's:
    what the region's placement alone allows, whatever the other regions' placements.

    As ``predict`` models the wall: its first batch, the steps at the region's wait, and DiLoCo's
    rounds, the first of which waits the region's own start-up skew (its first batch's lead over
    the earliest region's, plus the launch's stagger). Another region's late start is left out:
    it is that region's placement's cost, not this one's. The IO wait shares are over the wall
    after the first batch, the rounds' waits included (report.json's), so times ``step_s`` they
    give back seconds per step."""
    compute = p.steps * p.compute_s_per_step
    if compute <= 0 or p.steps <= 0:
        return {g.name: 1.0 for g in p.regions}
    rounds = p.outer_round_count
    busy = p.step_s - rounds * p.outer_sync_s_mean / p.steps - p.io_wait_share_after_first_batch * p.step_s
    earliest = min(g.time_to_first_batch_s for g in p.regions)
    stagger = cfg.constants.on_host().startup_skew_s
    out = {}
    for g in p.regions:
        step = busy + g.io_wait_share_after_first_batch * p.step_s
        skew = g.time_to_first_batch_s - earliest + stagger
        waits = rounds * outer.mean_round_wait_s(p.outer_round_s, cfg, step, skew) if rounds else 0.0
        out[g.name] = min(1.0, compute / (g.time_to_first_batch_s + p.steps * step + waits))
    return out


def _choose(
    inputs: OptimizeInputs, r: RegionSpec, options: list[Placement], seen: dict[str, dict[str, Seen]], cfg: SimConfig
) -> RegionChoice:
    figures = []
    for p in options:
        s = seen[p.tier][r.name]
        if p.tier == "remote":
            usd = s.remote_bytes / 1e9 * price(inputs.source_region, r.name, cfg.prices)[0]
        else:
            usd = _copy_usd(inputs, r.name, cfg)
        figures.append((p, s, usd))
    # the start counts where some placement of this region meets it: else the sync misses the target, not the placement
    start = any(breaks(inputs, s, start=True) is None for _, s, _ in figures)
    rows: list[Row] = [(p, s, usd, breaks(inputs, s, start)) for p, s, usd in figures]
    ok = [x for x in rows if x[3] is None]
    if ok:
        cheapest = min(x[2] for x in ok)
        best = min((x for x in ok if _same_cost(x[2], cheapest)), key=lambda x: x[0].rank)
    else:
        best = min(rows, key=lambda x: (x[1].io_wait, x[1].first_s, x[0].rank))
    p, s, usd, _ = best
    reason = _region_reason(inputs, r.name, best, rows)
    copy = usd if p.tier != "remote" else 0.0
    return RegionChoice(r.name, r.ranks, p, copy, s.io_wait, reason, tuple(rows))


def breaks(inputs: OptimizeInputs, s: Seen, start: bool) -> str | None:
    """Why a placement cannot be taken (its IO wait, or, with ``start``, its first batch holding the
    job under the utilization target), or None."""
    b = inputs.budgets
    if s.io_wait > b.io_wait:
        return f"waits {s.io_wait:.1%}"
    if start and s.ceiling < b.utilization:
        return f"starts in {s.first_s:,.1f} s: utilization at most {s.ceiling:.1%} < {b.utilization:.1%}"
    return None


def _copy_usd(inputs: OptimizeInputs, region: str, cfg: SimConfig) -> float:
    """The region's share copied once from the source region, per epoch; none under residency (born there)."""
    if region == inputs.source_region or inputs.residency:
        return 0.0
    return inputs.share_bytes(region) / 1e9 * price(inputs.source_region, region, cfg.prices)[0] / inputs.epochs


def _same_cost(a: float, b: float) -> bool:
    return abs(a - b) <= max(TOLERANCE_USD, TOLERANCE_SHARE * min(a, b))


def _region_reason(inputs: OptimizeInputs, region: str, best: Row, rows: list[Row]) -> str:
    p, s, usd, _ = best
    budget = inputs.budgets.io_wait
    cost = f"${usd:,.2f} of reads per epoch" if p.tier == "remote" else ("no copy" if usd == 0 else f"a copy ${usd:,.2f} per epoch")
    text = f"{p.label()}: IO wait {s.io_wait:.1%} {'<=' if s.io_wait <= budget else '>'} {budget:.0%}, {cost}"
    others = []
    for q, _, u, why in rows:
        if q == p:
            continue
        if why is not None:
            others.append(f"{q.label()} {why}")
        elif not _same_cost(u, usd):
            others.append(f"{q.label()} costs ${u:,.2f}")
        else:
            others.append(f"{q.label()} costs the same, with more parts")
    if inputs.residency and region != inputs.source_region:
        others.append("residency (routing by field) keeps its samples in it")
    return text + (f" ({'; '.join(others)})" if others else "")


def _candidate(inputs: OptimizeInputs, choice: SyncChoice, regions: tuple[RegionChoice, ...], cfg: SimConfig) -> Candidate:
    specs = tuple(_as_spec(r, c.placement) for r, c in zip(cfg.regions, regions, strict=True))
    p = predict(replace(cfg, regions=specs))
    b = inputs.budgets
    usd = p.egress_usd_total + sum(r.copy_usd for r in regions)
    checks = [
        BudgetCheck("io_wait", b.io_wait, p.io_wait_share_after_first_batch, p.io_wait_share_after_first_batch <= b.io_wait,
                    max(0.0, p.io_wait_share_after_first_batch - b.io_wait)),
        BudgetCheck("utilization", b.utilization, p.utilization, p.utilization >= b.utilization, max(0.0, b.utilization - p.utilization)),
    ]  # fmt: skip
    if b.egress_usd is not None:
        checks.append(BudgetCheck("egress_usd", b.egress_usd, usd, usd <= b.egress_usd, max(0.0, usd - b.egress_usd)))
    return Candidate(choice, regions, p, tuple(checks))


def _order(c: Candidate) -> tuple[tuple[int, int, int, int], float]:
    return c.sync.fidelity, -c.prediction.utilization


def _pick(found: list[Candidate]) -> Candidate:
    ok = [c for c in found if c.feasible]
    if not ok:
        return min(found, key=lambda c: (c.shortfall, c.egress_usd, *_order(c)))
    cheapest = min(c.egress_usd for c in ok)
    return min((c for c in ok if _same_cost(c.egress_usd, cheapest)), key=_order)


def _weights_reason(inputs: OptimizeInputs) -> str:
    ranks = ", ".join(f"{r.name} {r.ranks}" for r in inputs.base.regions)
    text = (
        f"weights = ranks ({ranks}): every rank reads the same samples per epoch at one --step-time, "
        "so a region's share of the corpus is its share of the ranks"
    )
    if inputs.residency:
        text += "; routing by field (residency): a region holds the samples of its origins, the weight states its share of compute"
    if inputs.plan is not None:
        had = {r.name: r.weight for r in inputs.plan.regions}
        job = {r.name: r.ranks for r in inputs.base.regions}
        total_had, total_job = sum(had[n] for n in job), sum(job.values())
        if any(abs(had[n] / total_had - job[n] / total_job) > 1e-9 for n in job) or set(had) != set(job):
            old = ":".join(f"{had[n]:g}" for n in job)
            text += f"; the input plan had {old}" + ("" if inputs.residency else ": re-split, the layout changes")
    return text


def _sync_reason(chosen: Candidate, found: list[Candidate], inputs: OptimizeInputs) -> str:
    checks = ", ".join(c.text() for c in chosen.checks)
    if not chosen.feasible:
        return f"{chosen.sync.label()}: no candidate meets every budget; this one misses them least ({checks})"
    ok = [c for c in found if c.feasible]
    cheapest = min(c.egress_usd for c in ok)
    tolerance = max(TOLERANCE_USD, TOLERANCE_SHARE * cheapest)
    why = "the cheapest" if chosen.egress_usd == cheapest else f"within ${tolerance:,.2f} of the cheapest, closer to synchronous training"
    return f"{chosen.sync.label()}: meets the budgets ({checks}); {why} of the {len(ok)} candidate(s) of {len(found)} that meet them"


def _alternatives(chosen: Candidate, found: list[Candidate]) -> tuple[tuple[str, str], ...]:
    """The best candidate of each sync kind not chosen, and the chosen kind's neighbours, with why not."""
    picks: list[Candidate] = []
    for kind in ("flat", "hierarchical", "diloco"):
        same = [c for c in found if c.sync.sync == kind and c is not chosen]
        if same:
            picks.append(min(same, key=lambda c: (not c.feasible, c.egress_usd if c.feasible else c.shortfall, *_order(c))))
    if chosen.sync.sync == "diloco":
        smaller = [c for c in found if c.sync.sync == "diloco" and c.sync.outer_steps < chosen.sync.outer_steps]
        if smaller:
            h = max(c.sync.outer_steps for c in smaller)
            picks.append(min((c for c in smaller if c.sync.outer_steps == h), key=lambda c: (not c.feasible, c.egress_usd)))
    out: list[tuple[str, str]] = []
    for c in dict.fromkeys(picks):
        if not c.feasible:
            why = c.failing()
        elif _same_cost(c.egress_usd, chosen.egress_usd):
            why = f"costs the same (${c.egress_usd:,.2f} per epoch); the chosen one is closer to synchronous training or faster"
        else:
            why = f"meets the budgets but costs ${c.egress_usd:,.2f} per epoch > ${chosen.egress_usd:,.2f}"
        out.append((c.sync.label(), why))
    return tuple(out)
