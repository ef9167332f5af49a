"""``geoshard plan optimize``: a matrix whose answer is known, budgets that cannot be met, the
command's whole output, bad input, the written plan loading as split and train load it, and one
proposal run under the WAN rehearsal against its prediction."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from geoshard.errors import ConfigError
from geoshard.optimize import Budgets, OptimizeInputs, optimize
from geoshard.plan import load_plan, parse_plan
from geoshard.sim import LinkSpec, RegionSpec, SimConfig
from geoshard.sim.calibrated import WAN

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
US, EU, SA = "us-east-1", "eu-west-1", "sa-east-1"
# The known answer's scenario: 2,000 steps of 200 ms over 80 GB of 40 KB samples, sa-east-1 behind
# 10 Mbit/s. Each figure that decides it stays MARGIN times away from its threshold (checked by
# deciding_margins), so that a re-calibration of the sim that erodes one fails here by name.
SAMPLES, SAMPLE_BYTES, STEP_TIME, STEPS, TARGET = 2_000_000, 40_000, "200ms", 2000, 0.8
MARGIN = 1.5


def write_inputs(tmp: Path, slow_latency: float = 150.0, slow_mbit: float = 10.0) -> tuple[Path, Path, Path]:
    """A plan of three regions with buckets, a matrix where sa-east-1 sits behind a slow link, and
    prices that make anything sent to or from it expensive."""
    wan = tmp / "wan.toml"
    links = [(US, EU, 38, 200), (US, SA, slow_latency, slow_mbit), (EU, SA, slow_latency + 30, slow_mbit)]
    wan.write_text("".join(f'[[link]]\na = "{a}"\nb = "{b}"\nlatency_ms = {ms}\nbandwidth_mbit = {mb}\n' for a, b, ms, mb in links))
    plan = tmp / "plan.toml"
    plan.write_text("".join(f'[regions.{r}]\nweight = 1\nbucket = "s3://corpus-{r}/train"\n' for r in (US, EU, SA)))
    prices = tmp / "prices.toml"
    prices.write_text(f'[egress.prices]\n"{US}>{SA}" = 0.5\n"{EU}>{SA}" = 0.5\n"{SA}" = 0.5\n')
    return plan, wan, prices


def run(*args: object, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GEOSHARD, "plan", "optimize", *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False)


def known(tmp: Path, *extra: object) -> subprocess.CompletedProcess[str]:
    plan, wan, prices = write_inputs(tmp)
    return run(
        "--regions", f"{US}:2,{EU}:1,{SA}:1", "--wan", wan, "--plan", plan, "--prices", prices, "--samples", SAMPLES,
        "--sample-bytes", SAMPLE_BYTES, "--hidden", 512, "--step-time", STEP_TIME, "--out", tmp / "out.toml", *extra,
    )  # fmt: skip


def _option(rep: dict[str, Any], region: str, placement: str) -> dict[str, Any]:
    (found,) = (o for o in rep["regions"][region]["options"] if o["placement"] == placement)
    return found


def deciding_margins(rep: dict[str, Any], io_budget: float = 0.05, target: float = TARGET) -> dict[str, float]:
    """Each figure that decides the known answer, as its ratio to its threshold (> 1: on the right side)."""
    sa_remote, eu_remote = _option(rep, SA, f"reads {US}'s bucket"), _option(rep, EU, f"reads {US}'s bucket")
    eu_copy = min(o["usd_per_epoch"] for o in rep["regions"][EU]["options"] if not o["placement"].startswith("reads"))
    synchronous = max(c["utilization"] for c in rep["candidates"] if c["train_args"][1] != "diloco")
    diloco = max(c["utilization"] for c in rep["candidates"] if c["train_args"][1] == "diloco")
    return {
        "sa-east-1 reading across: IO wait over the budget": sa_remote["io_wait_share_after_first_batch"] / io_budget,
        "eu-west-1 reading across: the budget over its IO wait": io_budget / max(eu_remote["io_wait_share_after_first_batch"], 1e-9),
        "eu-west-1 reading across: the idle share allowed over its start's": (1 - target) / (1 - eu_remote["utilization_at_most"]),
        "eu-west-1: a copy's cost over reading across": eu_copy / eu_remote["usd_per_epoch"],
        "flat and hierarchical: the target over their best utilization": target / synchronous,
        "diloco: the idle share allowed over its best's": (1 - target) / (1 - diloco),
    }


def test_known_answer_the_slow_expensive_region_reads_nothing_across_and_diloco_beats_flat(tmp_path: Path) -> None:
    # A run of 2,000 steps reads an eighth of an epoch: for eu-west-1, reading us-east-1's bucket
    # is cheaper than a copy of its share; for sa-east-1, behind 10 Mbit/s, it would break the IO budget.
    done = known(tmp_path, "--steps", STEPS, "--utilization", TARGET, "--json")
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    margins = deciding_margins(rep)
    thin = {name: round(m, 2) for name, m in margins.items() if m < MARGIN}
    assert not thin, f"the known answer holds by less than {MARGIN}x on: {thin} (all: {margins}); re-tune the scenario"
    regions = rep["regions"]
    assert regions[SA]["placement"] != "remote" and regions[SA]["data_region"] is None
    assert regions[EU]["placement"] == "remote" and regions[EU]["data_region"] == US
    sa_wait = _option(rep, SA, f"reads {US}'s bucket")["io_wait_share_after_first_batch"]
    assert f"reads us-east-1's bucket waits {sa_wait:.1%}" in regions[SA]["reason"], regions[SA]["reason"]
    assert _option(rep, SA, f"reads {US}'s bucket")["refused"] == f"waits {sa_wait:.1%}"
    per_region = rep["predicted"]["regions"]
    assert per_region[SA]["cross_region_data_bytes"] == 0 and per_region[EU]["cross_region_data_bytes"] > 0
    # sa-east-1 sends only its share of DiLoCo's rounds, peer to peer: gloo's ring sends to the
    # previous region (us-east-1 -> sa-east-1 -> eu-west-1 -> us-east-1), a third of the rounds' bytes
    sent = {e["to"]: e["bytes"] for e in rep["predicted"]["egress"] if e["from"] == SA and e["bytes"] > 0}
    assert list(sent) == [EU] and sent[EU] == pytest.approx(rep["predicted"]["outer"]["bytes"] / 3, rel=1e-6)
    assert rep["sync"]["train_args"][:2] == ["--sync", "diloco"] and rep["meets_budgets"]
    rejected = {x["candidate"].split(" ")[0]: x["why"] for x in rep["rejected"]}
    assert re.match(r"utilization \d+\.\d% < 80\.0% \(short by \d+\.\d points\)", rejected["flat"]), rejected
    assert rep["weights"] == {US: 2, EU: 1, SA: 1}
    written = load_plan(tmp_path / "out.toml")
    assert [(r.name, r.weight) for r in written.regions] == [(US, 2), (EU, 1), (SA, 1)]
    assert written.region(EU).bucket == f"s3://corpus-{US}/train-{EU}"  # beside us-east-1's prefix, not inside it
    assert written.region(SA).bucket == f"s3://corpus-{SA}/train"


def test_a_placement_that_starts_too_late_for_the_target_is_refused_however_cheap(tmp_path: Path) -> None:
    # At 1 s steps and 5 KB samples, sa-east-1 reading across keeps its IO wait inside the budget,
    # but its 8 workers each open a new connection for their first piece over the 2 Mbit/s link to
    # us-east-1's bucket, 8 flows sharing it (sim/loader.py): over a 100-step job it starts ~19 s
    # late and misses 80%. Reading across is about 2x cheaper than a copy; before the start
    # counted, it was taken and no candidate met the budgets. Each deciding figure stays MARGIN
    # times from its threshold.
    plan, wan, prices = write_inputs(tmp_path, slow_mbit=2.0)
    done = run(
        "--regions", f"{US}:2,{EU}:1,{SA}:1", "--wan", wan, "--plan", plan, "--prices", prices, "--samples", SAMPLES,
        "--sample-bytes", 5_000, "--hidden", 512, "--step-time", "1s", "--steps", 100, "--num-workers", 8,
        "--utilization", TARGET, "--out", tmp_path / "out.toml", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    across = _option(rep, SA, f"reads {US}'s bucket")
    own = _option(rep, SA, "own bucket")
    margins = {
        "reading across: the budget over its IO wait": 0.05 / max(across["io_wait_share_after_first_batch"], 1e-9),
        "reading across: a copy's cost over its": own["usd_per_epoch"] / across["usd_per_epoch"],
        "reading across: its start's idle share over the allowed": (1 - across["utilization_at_most"]) / (1 - TARGET),
        "own bucket: the allowed idle share over its start's": (1 - TARGET) / (1 - own["utilization_at_most"]),
    }
    thin = {name: round(m, 2) for name, m in margins.items() if m < MARGIN}
    assert not thin, f"the answer holds by less than {MARGIN}x on: {thin} (all: {margins}); re-tune the scenario"
    assert across["time_to_first_batch_s"] > 10 and across["utilization_at_most"] < TARGET <= own["utilization_at_most"]
    why = f"starts in {across['time_to_first_batch_s']:,.1f} s: utilization at most {across['utilization_at_most']:.1%} < 80.0%"
    assert across["refused"] == why and f"reads {US}'s bucket {why}" in rep["regions"][SA]["reason"]
    assert rep["regions"][SA]["placement"] != "remote" and own["refused"] is None
    assert rep["meets_budgets"] and rep["predicted"]["utilization"]["share"] >= TARGET
    assert rep["predicted"]["time_to_first_batch_s"] < across["time_to_first_batch_s"] / 10


def test_the_answer_follows_the_matrix_on_fast_links_synchronous_training_wins(tmp_path: Path) -> None:
    plan, wan, prices = write_inputs(tmp_path)
    fast = re.sub(r"latency_ms = \d+", "latency_ms = 1", wan.read_text())
    wan.write_text(re.sub(r"bandwidth_mbit = \d+", "bandwidth_mbit = 10000", fast))
    base = ["--regions", f"{US}:2,{EU}:1,{SA}:1", "--wan", wan, "--plan", plan, "--samples", 200_000, "--step-time", "150ms"]
    prices.write_text(f'[egress.prices]\n"{US}" = 0.0\n"{EU}" = 0.0\n"{SA}" = 0.0\n')  # a private network: nothing to save
    done = run(*base, "--prices", prices, "--out", tmp_path / "out.toml", "--json", "--hidden", 512, "--utilization", TARGET)
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    # Every candidate costs $0: the one closest to synchronous training that meets the target wins.
    # On 1 ms links the ring's messages cost more than its bytes, and hierarchical pays the
    # recalibrated hook_trip_s on each of its leaders' ring messages (docs/simulate.md): its ring is
    # slower than flat's 4-rank ring, so flat wins on time, and hierarchical (preferred at equal
    # cost) misses the target.
    best = {kind: max(c["utilization"] for c in rep["candidates"] if c["train_args"][1] == kind) for kind in ("flat", "hierarchical")}
    margins = {
        "flat: the idle share allowed over its": (1 - TARGET) / (1 - best["flat"]),
        "hierarchical: its idle share over the allowed": (1 - best["hierarchical"]) / (1 - TARGET),
    }
    thin = {name: round(m, 2) for name, m in margins.items() if m < MARGIN}
    assert not thin, f"the answer holds by less than {MARGIN}x on: {thin} (all: {margins}); re-tune the scenario"
    assert rep["sync"]["train_args"] == ["--sync", "flat"], rep["sync"]
    rejected = {x["candidate"].split(" ")[0]: x["why"] for x in rep["rejected"]}  # the best of each kind not chosen
    assert re.fullmatch(r"utilization \d+\.\d% < 80\.0% \(short by \d+\.\d points\)", rejected["hierarchical"]), rejected
    assert rep["egress_usd_per_epoch"] == 0 and rep["budgets"]["utilization"]["met"]


def inputs(regions: int, ranks: int, **kw: Any) -> OptimizeInputs:
    names = [f"r{i}" for i in range(regions)]
    per = [ranks // regions + (1 if i < ranks % regions else 0) for i in range(regions)]
    links = tuple(LinkSpec(a, b, 20 + (i * 7 + j) % 120, 1000) for i, a in enumerate(names) for j, b in enumerate(names) if i < j)
    specs = tuple(RegionSpec(n, r, "s3", None, 10**9 * r // ranks) for n, r in zip(names, per, strict=True))
    base = SimConfig(regions=specs, links=links, steps=10_000, params=10**6, step_time=0.2, constants=WAN)
    return OptimizeInputs(base=base, corpus_bytes=1e12, source_region="r0", **kw)


def test_the_search_grows_with_regions_not_with_their_product() -> None:
    small, large = optimize(inputs(4, 16)), optimize(inputs(64, 1000))
    # one prediction per placement kind and sync choice, whatever the regions: no product over them
    assert small.predictions == large.predictions and large.candidates == small.candidates
    assert large.seconds < 60, large.seconds  # a generous bound; bench/optimize_bench.py holds the goal


def test_budgets_that_cannot_be_met_give_the_closest_and_say_by_how_much(tmp_path: Path) -> None:
    done = known(tmp_path, "--utilization", 0.999, "--egress-budget", 0.0, "--json")
    assert done.returncode == 1
    rep = json.loads(done.stdout)
    assert not rep["meets_budgets"]
    b = rep["budgets"]
    assert not b["utilization"]["met"] and b["utilization"]["short_by"] == pytest.approx(0.999 - b["utilization"]["predicted"], abs=1e-6)
    assert not b["egress_usd"]["met"] and b["egress_usd"]["short_by"] == pytest.approx(b["egress_usd"]["predicted"], abs=1e-4)
    assert b["egress_usd"]["predicted"] == pytest.approx(rep["egress_usd_per_epoch"], abs=1e-4)
    (line,) = done.stderr.splitlines()
    assert re.fullmatch(
        r"geoshard: error: no plan meets the budgets; wrote the closest: "
        r"utilization \d+\.\d% < 99\.9% \(short by \d+\.\d points\); egress \$[\d,.]+ per epoch > \$0\.00 \(over by \$[\d,.]+\)",
        line,
    ), line
    assert "the closest, it misses: utilization" in (tmp_path / "out.toml").read_text().splitlines()[0]
    load_plan(tmp_path / "out.toml")
    lib = optimize(replace(inputs(3, 6), budgets=Budgets(utilization=1.0, egress_usd=0.0)))
    assert not lib.feasible and lib.chosen.shortfall == pytest.approx(sum(c.relative for c in lib.chosen.checks if not c.met))
    assert lib.chosen.failing().startswith("utilization") and "egress" in lib.chosen.failing()


NUM = r"[\d,]+(?:\.\d+)?"


def test_cli_whole_output_and_the_written_plan(tmp_path: Path) -> None:
    done = known(tmp_path, "--steps", STEPS, "--utilization", TARGET)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    rep = json.loads(known(tmp_path, "--steps", STEPS, "--utilization", TARGET, "--json", "--force").stdout)
    lines = done.stdout.splitlines()
    p = rep["predicted"]
    want = [
        rf"geoshard plan optimize: wrote {re.escape(str(tmp_path / 'out.toml'))} \(3 region\(s\), 4 rank\(s\); "
        rf"{rep['search']['candidates']} candidate\(s\), {rep['search']['predictions']} predictions in {NUM} s\)",
        re.escape(f"sync: {rep['sync']['reason']}"),
        re.escape(f"weights: {rep['weights_reason']}"),
        *(re.escape(f"  {r} ({g['ranks']} rank(s)): {g['reason']}") for r, g in rep["regions"].items()),
        re.escape(
            f"predicted for 2,000 steps (--steps): utilization {p['utilization']['share']:.1%}, IO wait "
            f"{p['io_wait_share_after_first_batch']:.1%}, first batch {p['time_to_first_batch_s']:.2f} s, gradient sync "
            f"{p['grad_sync_s_per_step'] * 1000:,.1f} ms per step, {p['outer']['round_count']:,} outer rounds, the job waits "
            f"{p['outer']['sync_s_mean']:.2f} s per round; egress ${rep['egress_usd_per_epoch']:,.2f} per epoch "
            f"(copies ${rep['copy_usd_per_epoch']:,.2f} of it)"
        ),
        "rejected:",
        *(re.escape(f"  {x['candidate']}: {x['why']}") for x in rep["rejected"]),
        re.escape("train with: " + " ".join(rep["train"])),
    ]
    assert len(lines) == len(want), done.stdout
    for line, pattern in zip(lines, want, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)
    assert p["outer"]["round_count"] == STEPS // int(rep["sync"]["train_args"][3])
    text = (tmp_path / "out.toml").read_text()
    assert text.splitlines()[1] == "# train with: " + " ".join(rep["train"])
    assert parse_plan(text).region_names == (US, EU, SA)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--regions", "us-east-1:0"], "--regions: 'us-east-1:0' is not REGION:RANKS with RANKS >= 1 (e.g. us-east-1:2,eu-west-1:1)"),
        (["--regions", f"{US}:1,ap-south-1:1"], "{plan}: unknown region 'ap-south-1'; plan has us-east-1, eu-west-1, sa-east-1"),
        (["--io-wait-budget", "1.5"], "--io-wait-budget must be a share between 0 and 1, got 1.5"),
        (["--source-region", "Bad_Region"], "--source-region: must be a region name"),
        (["--no-corpus"], "plan optimize: give the corpus' size: --corpus-bytes (e.g. 10TB) or --samples"),
        (["--wan", "/nonexistent.toml"], "/nonexistent.toml: WAN matrix file not found"),
        (["--missing-link"], "{wan}: no [[link]] between 'eu-west-1' and 'sa-east-1'; add one with a, b and latency_ms"),
        (["--exists"], "--out: {out} exists; pass --force to replace it"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path: Path, extra: list[str], message: str) -> None:
    plan, wan, _ = write_inputs(tmp_path)
    out = tmp_path / "out.toml"
    args: list[object] = ["--regions", f"{US}:1,{EU}:1,{SA}:1", "--wan", wan, "--plan", plan, "--samples", 1000, "--out", out]
    if extra == ["--no-corpus"]:
        args.remove("--samples"), args.remove(1000)
    elif extra == ["--missing-link"]:
        wan.write_text(wan.read_text().rsplit("[[link]]", 1)[0])
    elif extra == ["--exists"]:
        out.write_text("mine\n")
    else:
        args += extra
    done = run(*args)
    message = message.replace("{plan}", str(plan)).replace("{wan}", str(wan)).replace("{out}", str(out))
    assert done.returncode == 2 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"geoshard: error: {message}"), line
    assert out.read_text() == "mine\n" if extra == ["--exists"] else not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.toml")] == []


def test_inputs_refuse_a_source_outside_the_job() -> None:
    with pytest.raises(ConfigError, match="--source-region: us-west-2 is not one of the job's regions"):
        replace(inputs(2, 2), source_region="us-west-2")


Rehearsed = tuple[dict[str, Any], dict[str, Any]]
REH_STEPS, REH_REGIONS = 150, f"{US}:1,{EU}:1"
REH_MODEL = ("--batch-size", 16, "--num-workers", 1, "--hidden", 256, "--step-time", "100ms")
# The rehearsal's regions start ~7 s apart (REHEARSAL's startup_skew_s, every region launched on one
# host), which DiLoCo's first round waits: over a run of 150 steps of 100 ms no candidate reaches the
# default 90% (the best, DiLoCo H=100 overlapped, is predicted at ~82%). A 70% target keeps a run
# short enough for a test and leaves the proposal 1.5x inside it by idle share.
REH_TARGET = 0.7


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory: pytest.TempPathFactory) -> Rehearsed:
    """One proposal (each region on its local replica, on bench/wan-matrix.toml) written, split and
    trained under the WAN rehearsal: (the proposal's JSON, the run's report.json)."""
    from splitkit import make_corpus
    from synckit import cli

    tmp = tmp_path_factory.mktemp("rehearsed")
    make_corpus(tmp / "corpus", samples=3000, sample_bytes=300, shard_samples=200)
    given = tmp / "given.toml"
    given.write_text(
        '[shards]\nbytes = "40KB"\n' + "".join(f'[regions.{r}]\nweight = 1\nlocal = "{tmp / "split" / r}"\n' for r in (US, EU))
    )
    matrix = Path(__file__).resolve().parents[1] / "bench" / "wan-matrix.toml"
    done = run(
        "--regions", REH_REGIONS, "--wan", matrix, "--plan", given, "--samples", 3000, "--sample-bytes", 300, "--rehearsal",
        "--steps", REH_STEPS, *REH_MODEL, "--utilization", REH_TARGET, "--out", tmp / "plan.toml", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    proposal = json.loads(done.stdout)
    r = cli("split", tmp / "corpus", "--plan", tmp / "plan.toml", "--out", tmp / "split", "--workers", 1)
    assert r.exit_code == 0, r.output
    argv = [GEOSHARD, "train", "--plan", str(tmp / "plan.toml"), "--regions", REH_REGIONS, "--wan", str(matrix), "--out", str(tmp / "run")]
    argv += [*map(str, ("--steps", REH_STEPS, *REH_MODEL, "--backend", "gloo")), *proposal["sync"]["train_args"]]
    trained = subprocess.run(argv, capture_output=True, text=True, timeout=500, cwd=tmp, check=False)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    return proposal, json.loads((tmp / "run" / "report.json").read_text())


def _errors(proposal: dict[str, Any], report: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(predicted, measured) for each field both carry."""
    p = proposal["predicted"]
    out = {
        "utilization": (p["utilization"]["share"], report["utilization"]["share"]),
        "io_wait_share_after_first_batch": (p["io_wait_share_after_first_batch"], report["io_wait_share_after_first_batch"]),
        "time_to_first_batch_s": (p["time_to_first_batch_s"], report["time_to_first_batch_s"]),
        "grad_sync_s_per_step": (p["grad_sync_s_per_step"], report["grad_sync_s_per_step"]),
        "cross_region_grad_bytes_per_step": (p["cross_region_grad_bytes_per_step"], report["cross_region_grad_bytes_per_step"]),
    }
    if p["outer"] is not None:
        out["outer.sync_s_mean"] = (p["outer"]["sync_s_mean"], report["outer"]["sync_s_mean"])
    print({k: f"predicted {a:.4g}, measured {b:.4g}" for k, (a, b) in out.items()})
    return out


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN rehearsal needs root (CAP_NET_ADMIN)")
def test_a_proposal_run_under_the_rehearsal_lands_within_20_percent_on_utilization(
    rehearsed: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    proposal, report = rehearsed
    assert report["complete"] and report["sync"] == proposal["sync"]["train_args"][1]
    predicted, measured = _errors(proposal, report)["utilization"]
    assert (1 - REH_TARGET) / (1 - predicted) >= MARGIN, f"the proposal is predicted at {predicted:.1%}: re-tune REH_TARGET"
    assert abs(measured - predicted) <= 0.2 * predicted, (predicted, measured)
    if proposal["predicted"]["outer"] is not None:
        assert report["outer"]["round_count"] == proposal["predicted"]["outer"]["round_count"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN rehearsal needs root (CAP_NET_ADMIN)")
@pytest.mark.xfail(
    reason="the sim's calibration is not there yet on this machine: in the 2026-12-07 13:1x run (p2p, load < 2) the "
    "first batch (0.027 s predicted, 0.054 s measured) and the IO wait share (0.0038 against 0.0073) held within their "
    "floors, but the overlapped DiLoCo round's wait did not (0.12 s against 0.19 s; 0.19 s against 0.21 s on 12-04)",
    strict=False,
)
def test_the_other_reported_fields_land_within_20_percent(rehearsed: Rehearsed) -> None:
    proposal, report = rehearsed
    for name, (predicted, measured) in _errors(proposal, report).items():
        floor = 0.01 if "share" in name else 0.05 if name.endswith("_s") or "_s_" in name else 0.0  # shares, seconds
        assert abs(measured - predicted) <= max(0.2 * abs(predicted), floor), (name, predicted, measured)


def _planned(plan_text: str, sample_bytes: int, step_time: float = 0.2) -> OptimizeInputs:
    plan = parse_plan(plan_text)
    names = plan.region_names
    links = tuple(LinkSpec(a, b, 30, 1000) for i, a in enumerate(names) for b in names[i + 1 :])
    specs = tuple(RegionSpec(n, 1, "s3", None, 100_000) for n in names)
    base = SimConfig(regions=specs, links=links, steps=500, sample_bytes=sample_bytes, params=10**5, step_time=step_time, constants=WAN)
    return OptimizeInputs(base=base, corpus_bytes=len(names) * 100_000.0 * sample_bytes, source_region=names[0], plan=plan)


def test_a_bucket_too_slow_for_the_budget_gets_a_replica_and_residency_keeps_data_home() -> None:
    buckets = "".join(f'[regions.{r}]\nweight = 1\nbucket = "s3://c-{r}/t"\n' for r in (US, EU))
    # 32 samples of 2 MB every 0.2 s is 320 MB/s per rank: more than two workers fetch from a bucket (2 x 100 MB/s)
    # and less than from a replica (2 x 500 MB/s)
    heavy = optimize(_planned(buckets, 2_000_000))
    assert [r.placement.tier for r in heavy.chosen.regions] == ["local", "local"]
    assert "own bucket waits" in heavy.chosen.regions[0].reason
    light = optimize(_planned(buckets, 1000))
    assert [r.placement.tier for r in light.chosen.regions] == ["s3", "s3"]
    assert light.chosen.regions[1].copy_usd > 0  # eu-west-1's share copied from us-east-1
    field = '[routing]\npolicy = "field"\nfield = "origin"\n[routing.map]\nus = "us-east-1"\neu = "eu-west-1"\n' + buckets
    resident = optimize(_planned(field, 1000))
    assert all(r.placement.tier != "remote" and r.copy_usd == 0 for r in resident.chosen.regions)
    assert "residency" in resident.chosen.regions[1].reason and "residency" in resident.weights_reason
