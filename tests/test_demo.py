"""`geoshard demo` end to end, small: synthesize, split, a local S3 server, sync, one DDP job of
3 ranks in three regions, each through its own region's tier chain (Alluxio down, so local
replica and S3 serve), the report; then nothing it started is left running."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from geoshard.cli import main


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(pid))
    return found


def test_demo_runs_the_main_job_and_stops_everything(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    r = CliRunner().invoke(main, ["demo", "--out", str(out), "--samples", "3000", "--steps", "40"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "IO wait:" in r.output and ("within budget" in r.output or "over budget" in r.output)
    report = json.loads((out / "run" / "report.json").read_text())
    assert report["steps"] == 40 and len(report["ranks"]) == 3 and 0 <= report["io_wait_share"] <= 1
    assert set(report["regions"]) == {"us-east-1", "eu-west-1", "ap-southeast-1"}
    assert report["cross_region_data_bytes"] == 0 and report["cross_region_grad_bytes"] > 0 and report["sync"] == "hierarchical"
    tiers = report["tiers"]
    for region in report["regions"]:
        assert tiers[f"alluxio:{region}"]["errors"] >= 1 and tiers[f"alluxio:{region}"]["hits"] == 0, (
            "Alluxio is down: the chain falls back"
        )
        assert tiers[f"s3:{region}"]["hits"] >= 1, "the cold replica is filled from the region's bucket"
        assert any((out / "replica" / region).glob("*.tar")), "write-back filled the local replica"
    assert "regions" in r.output and "across regions: data 0 B (goal 0)" in r.output
    assert _processes_mentioning(str(out / "s3")) == [], "the S3 server is stopped"
    assert _processes_mentioning(str(out / "plan.toml")) == [], "no rank is left"
