"""``geoshard simulate``: predicts a ``geoshard train`` run from the same options, without running it
(geoshard/sim/, docs/simulate.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click

from geoshard.errors import ConfigError
from geoshard.trainer.options import train_options


def _kv(text: str | None, option: str) -> dict[str, str]:
    """``a=b,c=d`` → {a: b, c: d}; one line naming the option when malformed."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{option}: {part!r} is not REGION=VALUE (e.g. us-east-1=eu-west-1)")
        out[key.strip()] = value.strip()
    return out


@click.command()
@train_options
@click.option("--nproc", default=1, show_default=True, type=click.IntRange(min=1), help="Without --regions: ranks in each plan region.")
@click.option("--regions", "regions_spec", help="Ranks per region, e.g. us-east-1:2,eu-west-1:1 (as geoshard train).")
@click.option(
    "--wan", "wan_matrix", type=click.Path(dir_okay=False, path_type=Path), help="Latency/bandwidth matrix between the regions (TOML)."
)
@click.option("--rehearsal/--no-rehearsal", default=False, help="Model the WAN rehearsal (geoshard train --wan), not a real WAN.")
@click.option("--prices", "prices_file", type=click.Path(dir_okay=False, path_type=Path), help="Egress prices: TOML, [egress.prices].")
@click.option("--samples", default=0, type=click.IntRange(min=0), help="The corpus' samples over all regions (0: unknown).")
@click.option("--sample-bytes", default=1000, show_default=True, type=click.IntRange(min=1), help="Mean bytes per sample.")
@click.option("--shard-bytes", type=click.IntRange(min=1), help="Bytes per shard [default: the plan's shards.bytes].")
@click.option(
    "--params", type=click.IntRange(min=0), help="Model parameters [default: the built-in MLP's at --hidden; 0 with --model none]."
)
@click.option("--data-from", help="Regions reading another region's bucket: REGION=OTHER,...")
@click.option(
    "--constants",
    "constants_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The model's fitted constants (TOML, [constants]; bench/simulate_bench.py writes one).",
)
@click.option(
    "--host-slowdown",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.01, max=1000.0),
    help="How many times slower this host runs its own work than a dedicated core (a shared machine: load / cores).",
)
@click.option("--json", "as_json", is_flag=True, help="report.json's field names, for a field-by-field comparison with a run.")
def simulate(**kwargs: Any) -> None:
    """Predict a training run: first batch, IO wait, sync time, utilization, bytes and egress cost per region pair."""
    from geoshard.sim import predict

    cfg = sim_config(kwargs)
    prediction = predict(cfg)
    if kwargs["as_json"]:
        click.echo(json.dumps(prediction.to_report(), indent=1))
    else:
        click.echo(render(prediction.to_report(), cfg))


def sim_config(kw: dict[str, Any]) -> Any:
    """The options → a SimConfig (the CLI is the edge where files are read)."""
    from geoshard.sim import RegionSpec, SimConfig
    from geoshard.sim.calibrated import REHEARSAL, WAN, load_constants
    from geoshard.sim.grad import mlp_tensors
    from geoshard.sim.prices import load_prices, split_plan
    from geoshard.trainer.config import TrainConfig, parse_regions

    train_kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}}
    train_kw["out"] = train_kw.get("out") or Path("simulate")
    t = TrainConfig(**train_kw)  # the same checks as geoshard train
    plan, prices = split_plan(t.plan)
    if kw["prices_file"] is not None:
        prices = load_prices(kw["prices_file"]) + prices  # the file's figures first
    ranks = (
        parse_regions(kw["regions_spec"]) if kw["regions_spec"] else tuple(parse_regions(f"{r}:{kw['nproc']}") for r in plan.region_names)
    )
    ranks = tuple(x[0] if isinstance(x, tuple) else x for x in ranks)
    reads = _kv(kw["data_from"], "--data-from")
    names = [r.region for r in ranks]
    for region in (*reads, *reads.values()):
        if region not in names:
            raise ConfigError(f"--data-from: {region} is not one of the job's regions ({', '.join(names)})")
    weights = {r.name: r.weight for r in plan.regions}
    total_w = sum(weights[r.region] for r in ranks if r.region in weights) or 1.0
    specs = []
    for r in ranks:
        found = plan.region(r.region)  # an unknown region: one line naming the plan's regions
        tier = "local" if found.local else "alluxio" if found.alluxio else "s3"
        if r.region in reads:
            tier = "s3"
        share = round(kw["samples"] * weights[r.region] / total_w)
        specs.append(RegionSpec(r.region, r.nproc, tier, reads.get(r.region), share))
    links = _links(kw["wan_matrix"], len(specs))
    tensors = mlp_tensors(t.hidden) if kw["params"] is None and t.model != "none" else ()
    params = kw["params"] if kw["params"] is not None else sum(tensors)  # the built-in MLP's, or 0 with --model none
    sync = t.sync if t.sync != "auto" else ("hierarchical" if len(specs) > 1 else "flat")
    return SimConfig(
        regions=tuple(specs),
        links=links,
        steps=t.steps,
        batch_size=t.batch_size,
        accum_steps=t.accum_steps,
        num_workers=t.num_workers,
        prefetch=t.prefetch,
        sample_bytes=kw["sample_bytes"],
        shard_bytes=kw["shard_bytes"] or plan.shards.bytes,
        params=params,
        tensor_params=tensors,
        step_time=t.step_time,
        sync=sync,
        grad_compression=t.grad_compression,
        fp32_after=t.fp32_after,
        outer_steps=t.outer_steps,
        outer_overlap=t.outer_overlap,
        outer_compression=t.outer_compression,
        outer_transport=kw["outer_transport"],
        outer_streams=kw["outer_streams"],
        checkpoint_every=t.checkpoint_every,
        prices=prices,
        constants=dataclasses.replace(
            load_constants(kw["constants_file"], REHEARSAL if kw["rehearsal"] else WAN), host_slowdown=kw["host_slowdown"]
        ),
    )


def _links(matrix: Path | None, regions: int) -> tuple[Any, ...]:
    from geoshard.sim import LinkSpec
    from geoshard.wan.matrix import load_matrix

    if matrix is None:
        if regions > 1:
            raise ConfigError("simulate: a job across regions needs --wan MATRIX (one-way latency and bandwidth per pair; docs/wan.md)")
        return ()
    return tuple(LinkSpec(x.a, x.b, x.latency_ms, x.bandwidth_mbit) for x in load_matrix(matrix).links)


def render(rep: dict[str, Any], cfg: Any) -> str:
    """The human form: the job, then a line per region, the exchange, and the egress table."""
    from geoshard.util.units import human_bytes

    where = "the WAN rehearsal" if cfg.constants.ceiling_mb_s is not None else "a WAN"
    lines = [
        f"geoshard simulate: {rep['world_size']} rank(s) in {len(rep['regions'])} region(s), {rep['steps']:,} steps, "
        f"sync {rep['sync']}, on {where} (a prediction; docs/simulate.md)"
    ]
    for name, g in rep["regions"].items():
        tiers = ", ".join(f"{t} {human_bytes(n)}" for t, n in g["tier_bytes"].items())
        lines.append(
            f"  {name}: {g['ranks']} rank(s); first batch {g['time_to_first_batch_s']:.2f} s; IO wait after it "
            f"{g['io_wait_share_after_first_batch']:.2%}; bytes per tier: {tiers}"
            + (f" (from another region: {human_bytes(g['cross_region_data_bytes'])})" if g["cross_region_data_bytes"] else "")
        )
    lines.append(
        f"gradient sync {rep['grad_sync_s_per_step'] * 1000:,.0f} ms per step, "
        f"{human_bytes(rep['cross_region_grad_bytes_per_step'])} across regions per step; step {rep['step_s'] * 1000:,.0f} ms"
    )
    if rep["outer"] is not None:
        o = rep["outer"]
        lines.append(
            f"outer rounds: {o['round_count']:,}, each {o['round_s']:.2f} s of exchange, the job waits {o['sync_s_mean']:.2f} s per round; "
            f"{human_bytes(o['bytes'])} in all" + ("" if o["calibrated"] else " (int8/fp8 over p2p: not calibrated)")
        )
    lines.append(f"compute utilization {rep['utilization']['share']:.1%}")
    for e in rep["egress"]:
        lines.append(f"  {e['from']} -> {e['to']}: {human_bytes(e['bytes'])}, ${e['usd']:,.2f}")
    lines.append(f"egress cost ${rep['egress_usd']:,.2f} (prices: docs/simulate.md; --prices or the plan's [egress.prices])")
    return "\n".join(lines)


# Every option of geoshard train is accepted, so a train command line becomes a simulate one by
# its first word; simulate writes nothing, so --out is optional here.
for _p in simulate.params:
    if _p.name == "out":
        _p.required = False
