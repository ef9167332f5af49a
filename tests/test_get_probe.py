"""bench/get_probe.py run as a user runs it (root, the WAN rehearsal, one SeaweedFS): a ranged GET
from another region's bucket on a new connection pays the handshake and the request's round
trips, a kept connection does not, and the bucket's own region reads without a link."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN rehearsal needs root (CAP_NET_ADMIN)")
def test_a_new_connection_to_another_regions_bucket_costs_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    argv = [sys.executable, str(ROOT / "bench" / "get_probe.py"), "--pairs", "us-east-1=eu-west-1,us-east-1=us-east-1"]
    r = subprocess.run([*argv, "--repeats", "2", "--json-out", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert [re.match(r"(\S+ <- \S+) \(model", line).group(1) for line in lines if "(model" in line] == [  # type: ignore[union-attr]
        "us-east-1 <- eu-west-1",
        "us-east-1 <- us-east-1",
    ]
    assert lines[-1] == f"JSON: {out}"
    assert sum(line.startswith("    raw (connect, first byte, last byte)") for line in lines) == 2
    assert "Traceback" not in r.stdout + r.stderr
    remote, local = json.loads(out.read_text())["rows"]
    one_way = 0.038  # bench/wan-matrix.toml, us-east-1 <-> eu-west-1
    # connect (a round trip) + the request out and its first byte back: at least two round trips
    assert min(remote["all"]["cold"]) >= 4 * one_way * 0.9
    assert min(remote["all"]["raw_fresh"]) >= 4 * one_way * 0.9
    assert max(remote["all"]["warm"]) < min(remote["all"]["cold"])  # a kept connection skips the handshake and the ramp
    connect, first, last = remote["all"]["raw_phases"]["fresh"][0]
    assert 2 * one_way * 0.9 <= connect < first <= last
    assert remote["model_s"] > local["model_s"] > 0
    assert max(local["all"]["cold"]) < min(remote["all"]["cold"])
