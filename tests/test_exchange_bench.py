"""bench/exchange_bench.py's arithmetic: the ring's bound and the run plan (the bench itself needs
root and ~20 minutes under the WAN rehearsal; docs/benchmarks.md records its runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import exchange_bench  # noqa: E402

from geoshard.wan import load_matrix  # noqa: E402


@pytest.mark.parametrize(("mb", "issue_bound_s"), [(5.5, 1.03), (91, 10.1)])
def test_bound_is_the_issues_for_three_regions(mb: float, issue_bound_s: float) -> None:
    """Issue 23's table: 4/3 B over the slowest link (100 Mbit/s) + 4 one-way trips of 110 ms."""
    matrix = load_matrix(ROOT / "bench" / "wan-matrix.toml")
    b = exchange_bench.bound_s(matrix, exchange_bench.REGIONS, int(mb * 1e6))
    assert b["latency_s"] == pytest.approx(0.44)
    assert b["transfer_s"] == pytest.approx(4 / 3 * mb * 1e6 / 12.5e6)
    assert b["bound_s"] == pytest.approx(issue_bound_s, abs=0.05)  # the issue rounds B and the bound


def test_bound_for_two_regions_uses_their_link_only() -> None:
    matrix = load_matrix(ROOT / "bench" / "wan-matrix.toml")
    b = exchange_bench.bound_s(matrix, ("us-east-1", "eu-west-1"), 25_000_000)
    assert b["transfer_s"] == pytest.approx(25e6 / 25e6)  # 2(n-1)/n = 1, 200 Mbit/s
    assert b["latency_s"] == pytest.approx(2 * 0.038)


def test_plans_group_variants_by_launch_and_run_large_sizes_once() -> None:
    args = argparse.Namespace(sizes="22,360", repeats=3, once_from=300.0)
    plans = exchange_bench._plans(args, ["ring", "streams-8", "sharded-4", "torchft"])
    assert [(engine, ppr) for engine, ppr, _ in plans] == [("gloo", 1), ("gloo", 2), ("torchft", 1)]
    one = plans[0][2]
    assert one == [
        ["ring", 22_000_000, 1, 3],
        ["streams-8", 22_000_000, 1, 3],
        ["ring", 360_000_000, 0, 1],
        ["streams-8", 360_000_000, 0, 1],
    ]
    assert {v for v, *_ in plans[1][2]} == {"sharded-4"}


def test_a_trainer_row_carries_its_groups_times_into_the_table() -> None:
    """trainer-K's groups, made serially (the baseline) and at once, are reported beside its phases."""
    args = argparse.Namespace(matrix_obj=load_matrix(ROOT / "bench" / "wan-matrix.toml"))
    res = {
        "variant": "trainer-8",
        "bytes": 22_000_000,
        "times_s": [3.5, 3.7],
        "phases_s": {"0": {"first_transfer": 3.0, "transfer": [2.5, 2.7]}},
        "groups_s": {"serial": 23.0, "at_once": 3.2},
    }
    crossed = {"us-east-1>ap-southeast-1": 2 * 29_300_000}
    row = exchange_bench._row(res, crossed, 2.0, 1, None, args)  # type: ignore[arg-type]
    assert row["groups_s"] == {"serial": 23.0, "at_once": 3.2}
    assert row["median_s"] == pytest.approx(3.6) and row["max_link_B"] == pytest.approx(1.332)
    text = exchange_bench.table({"slowest": "x", "ceiling": {"packets_per_s": 1, "mb_per_s": 1.0}, "rows": [row]})
    assert "- trainer-8, 1 ranks/region: groups made serially 23.0 s, at once 3.2 s" in text.splitlines()


def test_the_cpu_sampler_reports_each_roles_cores_and_the_share_of_the_window_the_cores_were_saturated() -> None:
    """bench/cpu_sampler.py: from (time, machine ticks, role seconds) samples, the busy share over
    the window, the share of intervals at or above 95% busy, and each role's seconds and cores."""
    import os

    import cpu_sampler

    samples = [
        (0.0, (0, 0), {"forwarder": 1.0, "us-east-1": 2.0}),
        (1.0, (190, 200), {"forwarder": 1.1, "us-east-1": 2.5}),  # 95% busy: saturated
        (2.0, (290, 400), {"forwarder": 1.2, "us-east-1": 3.0}),  # 50%
    ]
    got = cpu_sampler.summarize(samples)
    assert got["window_s"] == 2.0 and got["busy"] == pytest.approx(0.725) and got["saturated"] == 0.5
    assert got["cpu_s"] == {"forwarder": 0.2, "us-east-1": 1.0} and got["cores"] == {"forwarder": 0.1, "us-east-1": 0.5}
    own = cpu_sampler.process_seconds(os.getpid())
    assert own is not None and own > 0  # this test process has run
    assert cpu_sampler.process_seconds(2**22 + 12345) is None  # no such process
    busy, total = cpu_sampler.machine_ticks()
    assert 0 < busy <= total
