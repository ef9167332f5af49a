"""The IO-wait report, its plot, the ``geoshard report`` command, live metrics and the Grafana
dashboard, on run directories written here the way the training loop writes them."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from geoshard.cli import main
from geoshard.cli.report import duration, render_report, report
from geoshard.errors import ConfigError, DataError
from geoshard.loaders.stats import LoaderStats, StatsSnapshot
from geoshard.trainer.metrics import Metrics
from geoshard.trainer.plot import plot_steps
from geoshard.trainer.record import StepRecord, write_steps
from geoshard.trainer.report import build_report, write_report
from geoshard.trainer.summary import LoaderSummary, RankSummary, write_summary

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def loader_stats(scale: int = 1) -> StatsSnapshot:
    """The counters of a tier chain that read 8 MB from the local replica (2 misses) and 2 MB from
    us-east-1's bucket (0.4 s and 0.2 s, one error) into eu-west-1, ``scale`` times over."""
    stats = LoaderStats()
    for _ in range(scale):
        for _ in range(8):
            stats.hit("local", 1_000_000, 0.01)
        for seconds in (0.4, 0.2):
            stats.hit("s3:us-east-1", 1_000_000, seconds)
            stats.add_egress("us-east-1", "eu-west-1", 1_000_000)
            stats.count("local", "misses")
            stats.writeback()
    stats.count("s3:us-east-1", "errors")
    return stats.snapshot()


def write_rank(
    run: Path,
    rank: int,
    *,
    steps: int = 10,
    wait: float = 0.01,
    first_wait: float = 1.0,
    compute: float = 0.2,
    comm: float = 0.05,
    checkpoint_every: int = 5,
    start_step: int = 0,
    summary: bool = True,
    world_size: int = 2,
) -> None:
    """Step records and the rank summary as the training loop writes them; 0.1 s of setup before the first step."""
    run.mkdir(parents=True, exist_ok=True)
    t, records = 0.1, []
    for i in range(steps):
        data_wait = first_wait if i == 0 else wait
        ckpt = 0.3 if (i + 1) % checkpoint_every == 0 else 0.0
        step_s = data_wait + compute + ckpt + 0.002
        t += step_s
        loss = 2.0 - 0.1 * i + 0.01 * rank
        records.append(
            StepRecord(start_step + i, rank, t, data_wait, compute, step_s, comm_s=comm, checkpoint_s=ckpt, loss=loss, samples=32)
        )
    write_steps(run / f"steps-rank{rank}.jsonl", records)
    if summary:
        doc = RankSummary(
            rank=rank,
            world_size=world_size,
            region="eu-west-1",
            backend="gloo",
            device="cpu",
            wall_s=t + 0.05,
            time_to_first_batch_s=first_wait,
            steps=steps,
            samples=32 * steps,
            loader=LoaderSummary(loader_stats()),
        )
        write_summary(run, doc)


def make_run(run: Path, **kw: Any) -> Path:
    for rank in range(2):
        write_rank(run, rank, **kw)
    return run


def invoke(*args: str | Path) -> Result:
    # The command inside a group of geoshard's own class, which turns GeoshardError into one line and its exit code.
    group = type(main)(name="geoshard", commands=[report])
    return CliRunner().invoke(group, ["report", *(str(a) for a in args)])


def assert_one_line_error(result: Result, code: int, *words: str) -> None:
    assert result.exit_code == code, (result.output, result.exception)
    err = result.stderr.strip()
    assert err.startswith("geoshard: error: ") and "\n" not in err, err
    assert "Traceback" not in result.output
    for w in words:
        assert w in err, err


# --- the report ---------------------------------------------------------------------------------


def test_shares_breakdown_and_loader_totals(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    write_rank(run, 1, wait=0.05, first_wait=2.0)  # rank 1 waits more
    r = build_report(run)

    ranks = {x["rank"]: x for x in r["ranks"]}
    assert set(ranks) == {0, 1} and r["world_size"] == 2 and r["complete"]
    for x in r["ranks"]:
        assert 0 <= x["io_wait_share"] <= 1
        parts = x["data_wait_s"] + x["compute_s"] + x["checkpoint_s"] + x["other_s"]
        assert parts == pytest.approx(x["wall_s"], abs=1e-5)
        assert x["comm_s"] <= x["compute_s"]
        assert x["steps"] == 10 and x["samples"] == 320
    wall = ranks[0]["wall_s"] + ranks[1]["wall_s"]
    wait = ranks[0]["data_wait_s"] + ranks[1]["data_wait_s"]
    assert ranks[0]["data_wait_s"] == pytest.approx(1.0 + 9 * 0.01)
    assert r["io_wait_share"] == pytest.approx(wait / wall, abs=1e-6)
    assert r["io_wait_share_max"] == ranks[1]["io_wait_share"] > ranks[0]["io_wait_share"]
    assert r["io_wait_share_mean"] == pytest.approx((ranks[0]["io_wait_share"] + ranks[1]["io_wait_share"]) / 2, abs=1e-6)
    # Without the first step (and the setup before it), the waits are the steady ones.
    steady = (9 * 0.01 + 9 * 0.05) / sum(x["wall_s"] - (0.1 + x["time_to_first_batch_s"] + 0.2 + 0.002) for x in r["ranks"])
    assert r["io_wait_share_after_first_batch"] == pytest.approx(steady, rel=1e-4)
    assert r["io_wait_share_after_first_batch"] < r["io_wait_share"]

    b = r["breakdown"]
    assert b["wall"]["seconds"] == pytest.approx(wall)
    disjoint = ("data_wait", "compute", "checkpoint", "other")
    assert sum(b[k]["seconds"] for k in disjoint) == pytest.approx(wall, abs=1e-5)
    assert sum(b[k]["share"] for k in disjoint) == pytest.approx(1.0, abs=1e-5)
    assert b["comm"]["seconds"] == pytest.approx(20 * 0.05) and b["checkpoint"]["seconds"] == pytest.approx(4 * 0.3)
    assert all(0 <= b[k]["share"] <= 1 for k in b)

    assert r["time_to_first_batch_s"] == 2.0
    assert r["steps"] == 10 and r["step_first"] == 0 and r["step_last"] == 9 and r["samples"] == 640
    assert r["region"] == "eu-west-1" and list(r["regions"]) == ["eu-west-1"]
    eu = r["regions"]["eu-west-1"]
    assert eu["ranks"] == 2 and eu["global_ranks"] == [0, 1] and eu["samples"] == 640
    assert eu["io_wait_share"] == r["io_wait_share"] and eu["time_to_first_batch_s"] == 2.0
    assert r["loss_first"] == pytest.approx(2.005) and r["loss_last"] == pytest.approx(1.105)
    assert r["tiers"]["local"]["hits"] == 16 and r["tiers"]["local"]["bytes"] == 16_000_000
    assert r["tiers"]["s3:us-east-1"]["fetch_seconds_mean"] == pytest.approx(0.3)
    assert r["tiers"]["s3:us-east-1"]["fetch_seconds_max"] == pytest.approx(0.4)
    assert r["egress_bytes"] == {"us-east-1->eu-west-1": 4_000_000} and r["writebacks"] == 4


def test_verdict_against_the_budget(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", first_wait=0.01)
    r = build_report(run)
    assert r["io_wait_share"] < 0.05 and r["within_budget"] and r["verdict"] == "within budget"
    r = build_report(run, budget=0.01)
    assert not r["within_budget"] and r["verdict"] == "over budget" and r["budget"] == 0.01
    with pytest.raises(ConfigError, match="budget"):
        build_report(run, budget=1.5)


def test_an_unfinished_rank_is_reported_from_its_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_rank(run, 0)
    write_rank(run, 1, summary=False, start_step=100)
    with (run / "steps-rank1.jsonl").open("a") as f:
        f.write('{"step": 110, "rank": 1, "t": 9')  # cut off mid-write
    r = build_report(run)
    rank1 = r["ranks"][1]
    last_t = json.loads((run / "steps-rank1.jsonl").read_text().splitlines()[-2])["t"]
    assert not r["complete"] and not rank1["finished"] and rank1["steps"] == 10
    assert rank1["wall_s"] == pytest.approx(last_t) and rank1["time_to_first_batch_s"] == 1.0
    assert r["step_first"] == 0 and r["step_last"] == 109
    assert "rank(s) 1 wrote no rank summary" in render_report(r, width=200)


def test_write_report_is_json_and_png(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    with (run / "steps-rank1.jsonl").open("a") as f:  # a diverged loss: NaN has no place in strict JSON
        f.write(json.dumps({"step": 10, "t": 4.0, "data_wait_s": 0.0, "compute_s": 0.2, "step_s": 0.2, "loss": math.nan}) + "\n")
    r = build_report(run)
    assert r["loss_last"] is None and r["loss_first"] is not None
    json_path, png_path = write_report(run, r)
    assert json.loads(json_path.read_text()) == r
    data = png_path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_plot_many_steps_many_ranks_and_none(tmp_path: Path) -> None:
    rec = StepRecord(step=0, rank=0, t=0.12, data_wait_s=0.01, compute_s=0.1, step_s=0.12)
    long_run = [dataclasses.replace(rec, step=i, data_wait_s=0.5 if i % 100 == 0 else 0.01) for i in range(5000)]
    many = {rank: [dataclasses.replace(rec, rank=rank, data_wait_s=0.001 * rank)] for rank in range(20)}
    for name, steps in (("long", {0: long_run, 1: []}), ("many", many), ("none", {})):
        out = plot_steps(steps, tmp_path / f"{name}.png", budget=0.05)
        data = out.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name


def test_render_report_has_every_section(tmp_path: Path) -> None:
    text = render_report(build_report(make_run(tmp_path / "run")), width=160)
    for words in (
        "IO wait:",
        "budget 5.0%",
        "over budget",
        "of which gradient sync",
        "checkpoint",
        "first batch after 1.0 s (slowest rank)",
        "s3:us-east-1",
        "16.0 MB",
        "us-east-1",
        "4.0 MB",
        "4 write-backs",
    ):
        assert words in text, words
    assert duration(0.25) == "250 ms" and duration(12.34) == "12.3 s" and duration(245) == "4m 05s" and duration(7380) == "2h 03m"


# --- the command ----------------------------------------------------------------------------------


def test_cli_table_writes_report_files(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", first_wait=0.01)
    result = invoke(run)
    assert result.exit_code == 0, result.output
    assert "within budget" in result.stdout and "of which gradient sync" in result.stdout
    assert (run / "report.json").is_file() and (run / "report.png").read_bytes().startswith(PNG_SIGNATURE)


def test_cli_json(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    result = invoke(run, "--json", "--budget", "0.5")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc == json.loads((run / "report.json").read_text())
    assert doc["budget"] == 0.5 and doc["within_budget"] and len(doc["ranks"]) == 2


def test_cli_fail_over_budget(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")  # a 1 s first batch in a 3.5 s run
    assert invoke(run).exit_code == 0  # over budget, but only reported
    result = invoke(run, "--fail-over-budget", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["verdict"] == "over budget"
    err = result.stderr.strip()
    assert "\n" not in err and "over the 5.0% budget" in err, err
    assert invoke(run, "--fail-over-budget", "--budget", "0.9").exit_code == 0


@pytest.mark.parametrize("budget", ["0", "1", "1.5", "-0.1", "five"])
def test_cli_bad_budget_exits_2(tmp_path: Path, budget: str) -> None:
    result = invoke(make_run(tmp_path / "run"), "--budget", budget)
    assert result.exit_code == 2 and "--budget" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("break_it", "code", "words"),
    [
        (lambda run: run.mkdir(), 1, ["no steps-rank*.jsonl or rank*.json"]),
        (lambda run: None, 2, ["no such run directory"]),
        (lambda run: (make_run(run), (run / "rank1.json").write_text("{not json")), 1, ["rank1.json: not valid JSON"]),
        (lambda run: (make_run(run), (run / "rank0.json").write_text("[1, 2]")), 1, ["rank0.json: expected a JSON object"]),
        (
            lambda run: (make_run(run), (run / "steps-rank0.jsonl").write_text('{"step": 0\n{"step": 1}\n')),
            1,
            ["steps-rank0.jsonl:1: not valid JSON"],
        ),
        (
            lambda run: (make_run(run), (run / "steps-rank1.jsonl").write_text('{"step": 3, "t": 1, "data_wait_s": -1}\n')),
            1,
            ["steps-rank1.jsonl:1", "data_wait_s"],
        ),
        (lambda run: (make_run(run), (run / "steps-rank1.jsonl").unlink()), 1, ["steps-rank1.jsonl: missing"]),
        (
            lambda run: (make_run(run), (run / "rank0.json").write_text(json.dumps({"rank": 0, "wall_s": 3, "loader": {"tiers": 5}}))),
            1,
            ["rank0.json: loader"],
        ),
    ],
    ids=["empty", "absent", "summary-not-json", "summary-not-object", "steps-not-json", "negative-wait", "no-steps-file", "bad-loader"],
)
def test_cli_bad_run_dir_is_one_line(tmp_path: Path, break_it: Any, code: int, words: list[str]) -> None:
    run = tmp_path / "run"
    break_it(run)
    assert_one_line_error(invoke(run), code, *words)
    with pytest.raises(DataError if code == 1 else ConfigError):
        build_report(run)


# --- live metrics -----------------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_served_on_loopback(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    with Metrics(0, rank=3, region="eu-west-1") as metrics:
        assert metrics.port
        own = {("rank", "3"), ("region", "eu-west-1")}
        first = StepRecord(step=0, rank=3, t=1.0, data_wait_s=0.5, compute_s=0.4, comm_s=0.1, step_s=0.9, samples=32)
        metrics.observe_step(first, loader_stats(1))
        before = scrape(metrics.port)
        assert ("geoshard_gpu_utilization", frozenset(own)) not in before  # not measured: absent, not 0
        second = dataclasses.replace(first, step=1, t=2.0, data_wait_s=0.1, comm_s=0.2, outer_sync_s=0.7)
        metrics.observe_step(second, loader_stats(3), gpu_util=0.75)
        values = scrape(metrics.port)

        def v(name: str, **labels: str) -> float:
            return values[(name, frozenset(own | set(labels.items())))]

        assert v("geoshard_data_wait_seconds_total") == pytest.approx(0.6)
        assert v("geoshard_grad_sync_seconds_total") == pytest.approx(0.3)
        assert v("geoshard_outer_sync_seconds_total") == pytest.approx(0.7)
        assert v("geoshard_samples_total") == 64
        assert v("geoshard_io_wait_share") == pytest.approx(0.3)
        assert v("geoshard_gpu_utilization") == 0.75
        assert v("geoshard_step_seconds_count") == 2 and v("geoshard_step_seconds_sum") == pytest.approx(1.8)
        assert v("geoshard_step_seconds_bucket", le="1.0") == 2 and v("geoshard_step_seconds_bucket", le="0.5") == 0
        # Cumulative loader stats become increments; latency is the mean of the fetches since the last step.
        assert v("geoshard_tier_bytes_total", tier="local") == 24_000_000
        assert v("geoshard_tier_bytes_total", tier="s3:us-east-1") == 6_000_000
        assert v("geoshard_tier_fetch_seconds", tier="s3:us-east-1") == pytest.approx(1.2 / 4)
        assert v("geoshard_egress_bytes_total", source="us-east-1", reader="eu-west-1") == 6_000_000
        # A new loader starts its counters again: its bytes add on.
        metrics.observe_step(dataclasses.replace(second, step=2, t=3.0), loader_stats(1))
        assert scrape(metrics.port)[("geoshard_tier_bytes_total", frozenset(own | {("tier", "local")}))] == 32_000_000
        with pytest.raises(ValueError, match=r"0\.\.1"):
            metrics.observe_step(second, None, gpu_util=75.0)
    assert not [name for name in REGISTRY._names_to_collectors if name.startswith("geoshard_")]
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", metrics.port), timeout=2):
        pass  # the server is closed


def test_metrics_off_is_a_no_op() -> None:
    metrics = Metrics(None, rank=0, region="us-east-1")
    metrics.observe_step(StepRecord(step=0, rank=0, t=1.0, data_wait_s=0.5, compute_s=0.1, step_s=0.6), loader_stats(), gpu_util=0.5)
    metrics.close()
    assert metrics.registry is None and metrics.port is None


def test_metrics_port_in_use_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1"):
            Metrics(taken.getsockname()[1], rank=0, region="us-east-1")
    with pytest.raises(ConfigError, match=r"0\.\.65535"):
        Metrics(70000, rank=0, region="us-east-1")


# --- the Grafana dashboard -------------------------------------------------------------------------


def exposed_names(metrics: Metrics) -> set[str]:
    """Series names the registry exposes, from each family's type (prometheus-client's suffixes)."""
    assert metrics.registry is not None
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}
    return {f.name + s for f in metrics.registry.collect() for s in suffixes[f.type]}


def test_dashboard_queries_only_metrics_we_define() -> None:
    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    assert 36 <= dash["schemaVersion"] <= 41 and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    with Metrics(0, rank=0, region="us-east-1") as metrics:
        names = exposed_names(metrics)
    used: set[str] = set()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        for target in panel["targets"]:
            refs = set(re.findall(r"\bgeoshard_[a-z_]+", target["expr"]))
            assert refs and refs <= names, (panel["title"], refs - names)
            used |= refs
    for v in variables.values():
        assert set(re.findall(r"\bgeoshard_[a-z_]+", v.get("definition", ""))) <= names
    for metric in (
        "geoshard_gpu_utilization",
        "geoshard_data_wait_seconds_total",
        "geoshard_grad_sync_seconds_total",
        "geoshard_outer_sync_seconds_total",
        "geoshard_tier_fetch_seconds",
        "geoshard_tier_bytes_total",
        "geoshard_egress_bytes_total",
    ):
        assert metric in used, metric
    (io_wait,) = [p for p in dash["panels"] if p["type"] == "timeseries" and "IO-wait" in p["title"]]
    defaults = io_wait["fieldConfig"]["defaults"]
    assert defaults["unit"] == "percentunit" and defaults["custom"]["thresholdsStyle"]["mode"] == "line"
    assert 0.05 in [s["value"] for s in defaults["thresholds"]["steps"]]


# --- the picture: a panel per region, the WAN's latencies -------------------------------------------


def wan_run(run: Path) -> Path:
    """Three ranks in two regions under a WAN matrix: gradient sync in compute, DiLoCo-like outer rounds in eu-west-1."""
    from geoshard.trainer.diloco.record import RoundRecord, append, rounds_path

    run.mkdir(parents=True)
    for rank, region in enumerate(("us-east-1", "us-east-1", "eu-west-1")):
        records = [
            StepRecord(i, rank, 0.3 * (i + 1), 0.01, 0.25, 0.3, comm_s=0.2, outer_sync_s=0.04 if i % 5 == 4 else 0.0, region=region)
            for i in range(10)
        ]
        write_steps(run / f"steps-rank{rank}.jsonl", records)
        write_summary(run, RankSummary(rank=rank, world_size=3, region=region, wall_s=3.0, steps=10, sync="hierarchical"))
    for step in (5, 10):
        append(rounds_path(run, "eu-west-1"), RoundRecord(round=step // 5, step=step, regions=("eu-west-1",), region="eu-west-1"))
    matrix = run.parent / "wan.toml"
    matrix.write_text('[[link]]\na = "us-east-1"\nb = "eu-west-1"\nlatency_ms = 38\n')
    (run / "wan.json").write_text(json.dumps({"matrix": str(matrix), "links": []}))
    return run


def legend_labels(ax: Any) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_plot_has_a_panel_per_region_with_sync_apart_and_the_latency_heatmap(tmp_path: Path) -> None:
    from geoshard.trainer.diloco.record import read_rounds
    from geoshard.trainer.plot import steps_figure
    from geoshard.trainer.report import wan_latency
    from geoshard.trainer.rundir import read_run

    run = wan_run(tmp_path / "run")
    steps = {rank: r.steps for rank, r in read_run(run).items()}
    latency = wan_latency(run)
    assert latency == {("us-east-1", "eu-west-1"): 38.0}
    fig = steps_figure(
        steps, budget=0.05, regions={0: "us-east-1", 1: "us-east-1", 2: "eu-west-1"}, rounds=read_rounds(run), latency_ms=latency
    )
    axes = [ax for ax in fig.axes if ax.get_title(loc="left")]
    titles = [ax.get_title(loc="left") for ax in axes]
    assert titles == [
        "us-east-1: ranks 0, 1, 10 steps (means over its ranks)",
        "eu-west-1: rank 2, 10 steps",
        "WAN rehearsal: one-way latency between regions (ms)",
    ]
    us, eu, heat = axes
    series = ["data wait", "compute", "gradient sync", "outer rounds (DiLoCo)"]
    assert legend_labels(us) == [*series, "data-wait share", "budget 5%"]
    assert legend_labels(eu) == ["outer round", *series, "data-wait share", "budget 5%"]
    # The bars stack to each step: compute without the sync, the sync and the outer round apart.
    heights = {c.get_label(): [round(b.get_height(), 6) for b in c] for c in us.containers}
    assert heights["compute"][0] == 0.05 and heights["gradient sync"][0] == 0.2 and heights["outer rounds (DiLoCo)"][4] == 0.04
    assert [line.get_xdata()[0] for line in eu.get_lines() if line.get_linestyle() == ":"] == [5, 10]
    assert [t.get_text() for t in heat.get_xticklabels()] == ["us-east-1", "eu-west-1"]
    assert sorted(t.get_text() for t in heat.texts) == ["-", "-", "38 ms", "38 ms"]
    # A run without DiLoCo, gradient sync or WAN keeps its picture to data wait and compute.
    plain = make_run(tmp_path / "plain", comm=0.0)
    fig = steps_figure({rank: r.steps for rank, r in read_run(plain).items()}, regions={0: "eu-west-1", 1: "eu-west-1"})
    assert [legend_labels(ax) for ax in fig.axes if ax.get_legend()] == [["data wait", "compute", "data-wait share"]]
    assert wan_latency(plain) is None


def test_write_report_draws_the_wan_run(tmp_path: Path) -> None:
    run = wan_run(tmp_path / "run")
    _, png = write_report(run, build_report(run))
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
