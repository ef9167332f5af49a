"""``geoshard plan optimize``: the cheapest plan that meets the budgets, from geoshard.sim's
predictions (geoshard/optimize/, docs/plan.md "Choosing a plan")."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from geoshard.errors import ConfigError
from geoshard.trainer.options import DURATION
from geoshard.util.units import parse_size


class _Parsed(click.ParamType):
    def __init__(self, name: str, parse: Any) -> None:
        self.name, self.parse = name, parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = _Parsed("SIZE", parse_size)
FILE = click.Path(dir_okay=False, path_type=Path)


@click.group()
def plan() -> None:
    """Region plans: choose one from a WAN matrix, prices and budgets."""


@plan.command()
@click.option("--regions", "regions_spec", required=True, help="Ranks per region, e.g. us-east-1:2,eu-west-1:1 (as geoshard train).")
@click.option("--wan", "wan_matrix", type=FILE, help="Latency/bandwidth matrix (geoshard probe --write-wan, docs/wan.md).")
@click.option("--plan", "plan_path", type=FILE, help="A plan to start from: its buckets, replicas, Alluxio, routing (residency), shards.")
@click.option("--corpus-bytes", type=SIZE, help="The corpus' size over all regions, e.g. 10TB.")
@click.option("--samples", type=click.IntRange(min=1), help="The corpus' samples over all regions.")
@click.option("--sample-bytes", default=1000, show_default=True, type=click.IntRange(min=1), help="Mean bytes per sample.")
@click.option("--shard-bytes", type=SIZE, help="Bytes per shard [default: the plan's shards.bytes, else 64MB].")
@click.option("--source-region", help="Where the corpus is split and uploaded from [default: the first of --regions].")
@click.option("--epochs", default=1, show_default=True, type=click.IntRange(min=1), help="Epochs to train (copies are spread over them).")
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps to predict [default: one epoch of the corpus].")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--accum-steps", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--hidden", default=128, show_default=True, type=click.IntRange(min=1), help="The built-in model's width.")
@click.option("--model", type=click.Choice(["mlp", "none"]), default="mlp", show_default=True)
@click.option("--params", type=click.IntRange(min=0), help="Model parameters [default: the built-in MLP's at --hidden].")
@click.option("--num-workers", default=2, show_default=True, type=click.IntRange(min=0))
@click.option("--prefetch", default=2, show_default=True, type=click.IntRange(min=0))
@click.option("--step-time", type=DURATION, default="0", help="Compute per step besides the model's, e.g. 80ms.")
@click.option("--checkpoint-every", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--prices", "prices_file", type=FILE, help="Egress prices: TOML, [egress.prices] (default: the sim's AWS table).")
@click.option("--rehearsal/--no-rehearsal", default=False, help="Model the WAN rehearsal (geoshard train --wan), not a real WAN.")
@click.option("--constants", "constants_file", type=FILE, help="The model's fitted constants (TOML, [constants]).")
@click.option("--io-wait-budget", default=0.05, show_default=True, type=float, help="IO wait after the first batch, share of wall time.")
@click.option("--utilization", default=0.9, show_default=True, type=float, help="Compute utilization target.")
@click.option("--egress-budget", type=float, help="USD per epoch (gradients, rounds, reads, copies spread over --epochs).")
@click.option("--max-outer-steps", default=100, show_default=True, type=click.IntRange(min=1), help="DiLoCo's H at most.")
@click.option("--local-root", default="/var/lib/geoshard", show_default=True, help="A proposed replica: LOCAL_ROOT/<region>.")
@click.option("--out", required=True, type=FILE, help="The plan TOML to write.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the proposal as JSON on stdout.")
@click.pass_context
def optimize(ctx: click.Context, **kw: Any) -> None:
    """Propose weights, where each region's data lives and the sync: the cheapest plan (egress USD)
    that meets the budgets, written to --out; exit 1 when none meets them (the closest is written)."""
    from geoshard.optimize import optimize as search
    from geoshard.optimize import render_plan, write_plan

    inputs = optimize_inputs(kw)
    proposal = search(inputs)
    regions = ",".join(f"{r.name}:{r.ranks}" for r in inputs.base.regions)
    train = ["geoshard", "train", "--plan", str(kw["out"]), "--regions", regions, *proposal.chosen.sync.train_args()]
    header = [
        f"geoshard plan optimize: {proposal.chosen.sync.label()}; "
        + ("meets every budget" if proposal.feasible else f"the closest, it misses: {proposal.chosen.failing()}"),
        "train with: " + " ".join(train),
    ]
    if inputs.plan is None:
        header.append("no --plan was given: add each region's bucket (and endpoint) before geoshard split and sync (docs/plan.md)")
    text = render_plan(inputs, proposal, header, kw["shard_bytes"])
    write_plan(kw["out"], text, kw["force"])
    rep = proposal_json(proposal, inputs, kw["out"], train, kw["steps"] is None)
    click.echo(json.dumps(rep, indent=1) if kw["as_json"] else render(rep))
    if not proposal.feasible:
        click.echo(f"geoshard: error: no plan meets the budgets; wrote the closest: {proposal.chosen.failing()}", err=True)
        ctx.exit(1)


def optimize_inputs(kw: dict[str, Any]) -> Any:
    """The options → OptimizeInputs (files are read here, at the edge)."""
    from geoshard.optimize import Budgets, OptimizeInputs
    from geoshard.plan.names import check_region_name
    from geoshard.sim import RegionSpec, SimConfig
    from geoshard.sim.calibrated import REHEARSAL, WAN, load_constants
    from geoshard.sim.grad import mlp_tensors
    from geoshard.sim.prices import load_prices, split_plan
    from geoshard.trainer.config import parse_regions

    budgets = Budgets(kw["io_wait_budget"], kw["utilization"], kw["egress_budget"])
    ranks = parse_regions(kw["regions_spec"])
    plan, prices = split_plan(kw["plan_path"]) if kw["plan_path"] else (None, ())
    if kw["prices_file"] is not None:
        prices = load_prices(kw["prices_file"]) + prices  # the file's figures first
    if plan is not None:
        for r in ranks:
            plan.region(r.region)  # one line naming the plan's regions, before the matrix is read
    samples, corpus = _corpus(kw)
    world = sum(r.nproc for r in ranks)
    steps = kw["steps"] or max(1, math.ceil(samples / (world * kw["batch_size"] * kw["accum_steps"])))
    replicate = plan is not None and plan.routing.policy == "replicate"
    specs = tuple(RegionSpec(r.region, r.nproc, "s3", None, samples if replicate else round(samples * r.nproc / world)) for r in ranks)
    hidden = kw["hidden"]
    params = kw["params"] if kw["params"] is not None else (0 if kw["model"] == "none" else hidden**2 + 268 * hidden + 10)
    base = SimConfig(
        regions=specs,
        links=_links(kw["wan_matrix"], [r.region for r in ranks]),
        steps=steps,
        batch_size=kw["batch_size"],
        accum_steps=kw["accum_steps"],
        num_workers=kw["num_workers"],
        prefetch=kw["prefetch"],
        sample_bytes=kw["sample_bytes"],
        shard_bytes=kw["shard_bytes"] or (plan.shards.bytes if plan is not None else 64_000_000),
        params=params,
        tensor_params=mlp_tensors(hidden) if kw["params"] is None and kw["model"] == "mlp" else (),
        step_time=kw["step_time"],
        checkpoint_every=kw["checkpoint_every"],
        prices=prices,
        constants=load_constants(kw["constants_file"], REHEARSAL if kw["rehearsal"] else WAN),
    )
    source = check_region_name(kw["source_region"], "--source-region") if kw["source_region"] else ranks[0].region
    return OptimizeInputs(
        base=base,
        corpus_bytes=corpus,
        source_region=source,
        budgets=budgets,
        plan=plan,
        epochs=kw["epochs"],
        max_outer_steps=kw["max_outer_steps"],
        local_root=kw["local_root"],
    )


def _corpus(kw: dict[str, Any]) -> tuple[int, float]:
    """(samples, bytes) of the corpus from --samples and/or --corpus-bytes."""
    if kw["samples"] is None and kw["corpus_bytes"] is None:
        raise ConfigError("plan optimize: give the corpus' size: --corpus-bytes (e.g. 10TB) or --samples")
    if kw["corpus_bytes"] is not None and kw["corpus_bytes"] < 1:
        raise ConfigError("--corpus-bytes: must be at least 1 byte")
    samples = kw["samples"] or max(1, kw["corpus_bytes"] // kw["sample_bytes"])
    return samples, float(kw["corpus_bytes"] or samples * kw["sample_bytes"])


def _links(matrix: Path | None, names: list[str]) -> tuple[Any, ...]:
    """Every pair of the job's regions from the matrix; one line naming a missing pair."""
    from geoshard.sim import LinkSpec
    from geoshard.wan.matrix import load_matrix

    if len(names) < 2:
        return ()
    if matrix is None:
        raise ConfigError("plan optimize: a job across regions needs --wan MATRIX (geoshard probe --write-wan writes one; docs/wan.md)")
    m = load_matrix(matrix)
    have = {x.pair: x for x in m.links}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if frozenset((a, b)) not in have:
                raise ConfigError(f"{matrix}: no [[link]] between {a!r} and {b!r}; add one with a, b and latency_ms")
    wanted = set(names)
    return tuple(LinkSpec(x.a, x.b, x.latency_ms, x.bandwidth_mbit) for x in m.links if x.a in wanted and x.b in wanted)


def proposal_json(proposal: Any, inputs: Any, out: Path, train: list[str], steps_are_epoch: bool) -> dict[str, Any]:
    c = proposal.chosen
    rep = c.prediction.to_report()
    return {
        "plan": str(out),
        "meets_budgets": proposal.feasible,
        "sync": {"label": c.sync.label(), "train_args": c.sync.train_args(), "reason": proposal.sync_reason},
        "train": train,
        "weights": dict(proposal.weights),
        "weights_reason": proposal.weights_reason,
        "regions": {
            r.name: {
                "ranks": r.ranks,
                "placement": r.placement.tier,
                "data_region": r.placement.data_region,
                "copy_usd_per_epoch": round(r.copy_usd, 4),
                "io_wait_share_after_first_batch": round(r.io_wait, 6),
                "reason": r.reason,
                "options": [
                    {
                        "placement": q.label(),
                        "io_wait_share_after_first_batch": round(f.io_wait, 6),
                        "time_to_first_batch_s": round(f.first_s, 6),
                        "utilization_at_most": round(f.ceiling, 6),
                        "usd_per_epoch": round(usd, 4),
                        "refused": why,
                    }
                    for q, f, usd, why in r.options
                ],
            }
            for r in c.regions
        },
        "budgets": {
            b.name: {"limit": b.limit, "predicted": round(b.predicted, 6), "met": b.met, "short_by": round(b.short_by, 6)} for b in c.checks
        },
        "egress_usd_per_epoch": round(c.egress_usd, 4),
        "copy_usd_per_epoch": round(c.copy_usd, 4),
        "predicted": rep,
        "rejected": [{"candidate": a, "why": w} for a, w in proposal.alternatives],
        "candidates": [
            {
                "candidate": x.sync.label(),
                "train_args": x.sync.train_args(),
                "utilization": round(x.prediction.utilization, 6),
                "io_wait_share_after_first_batch": round(x.prediction.io_wait_share_after_first_batch, 6),
                "egress_usd_per_epoch": round(x.egress_usd, 4),
                "meets_budgets": x.feasible,
            }
            for x in proposal.found
        ],
        "search": {"candidates": proposal.candidates, "predictions": proposal.predictions, "seconds": round(proposal.seconds, 4)},
        "source_region": inputs.source_region,
        "epochs": inputs.epochs,
        "steps_are_one_epoch": steps_are_epoch,
    }


def render(rep: dict[str, Any]) -> str:
    p, s = rep["predicted"], rep["search"]
    lines = [
        f"geoshard plan optimize: wrote {rep['plan']} ({len(rep['regions'])} region(s), {p['world_size']} rank(s); "
        f"{s['candidates']} candidate(s), {s['predictions']} predictions in {s['seconds']:.2f} s)",
        f"sync: {rep['sync']['reason']}",
        f"weights: {rep['weights_reason']}",
    ]
    lines += [f"  {name} ({g['ranks']} rank(s)): {g['reason']}" for name, g in rep["regions"].items()]
    outer = p["outer"]
    span = "one epoch" if rep["steps_are_one_epoch"] else "--steps"
    rounds = f", {outer['round_count']:,} outer rounds, the job waits {outer['sync_s_mean']:.2f} s per round" if outer else ""
    lines.append(
        f"predicted for {p['steps']:,} steps ({span}): utilization {p['utilization']['share']:.1%}, IO wait "
        f"{p['io_wait_share_after_first_batch']:.1%}, first batch {p['time_to_first_batch_s']:.2f} s, gradient sync "
        f"{p['grad_sync_s_per_step'] * 1000:,.1f} ms per step{rounds}; egress ${rep['egress_usd_per_epoch']:,.2f} per epoch "
        f"(copies ${rep['copy_usd_per_epoch']:,.2f} of it)"
    )
    if rep["rejected"]:
        lines.append("rejected:")
        lines += [f"  {x['candidate']}: {x['why']}" for x in rep["rejected"]]
    lines.append("train with: " + " ".join(rep["train"]))
    return "\n".join(lines)
