"""`geoshard demo` end to end, small, as a user runs it (a subprocess): synthesize, split, a local
S3 server, sync, one DDP job of 3 ranks in three regions, each through its own region's tier chain
(Alluxio down, so local replica and S3 serve), the report and its plot; as root under the WAN
rehearsal (every packet between regions through its links), then the same samples with DiLoCo,
the two runs side by side; then nothing it started is left running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
REGIONS = {"us-east-1", "eu-west-1", "ap-southeast-1"}


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


def _namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"geoshard-wan-{pid}-")]


@pytest.mark.slow
def test_demo_runs_the_main_job_across_three_regions_and_stops_everything(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [GEOSHARD, "demo", "--out", str(out), "--samples", "3000", "--steps", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    lines = stdout.splitlines()
    assert lines[0] == f"geoshard demo: 3,000 synthetic samples -> three regions under {out}/"
    wan = os.geteuid() == 0
    if wan:
        assert lines[1] == f"running as root: training under the WAN rehearsal ({out / 'wan.toml'}); --wan off to train on loopback"
        assert any(line.startswith("WAN rehearsal: us-east-1, eu-west-1, ap-southeast-1 in their own network namespaces") for line in lines)
        crossed = json.loads((out / "run" / "wan.json").read_text())
        assert {(x["from"], x["to"]) for x in crossed["links"] if x["bytes"] > 0} == {(a, b) for a in REGIONS for b in REGIONS if a != b}
        # The same samples again with DiLoCo, and the two side by side (bytes: the forwarder's count).
        diloco = json.loads((out / "run-diloco" / "report.json").read_text())
        assert diloco["sync"] == "diloco" and diloco["outer"]["round_count"] == 2 and diloco["steps"] == 20
        head = lines.index("the same corpus and 20 steps, two ways across the WAN rehearsal:")
        ddp_line, diloco_line = lines[head + 1 : head + 3]
        for line, name, run in ((ddp_line, "hierarchical DDP       ", "run"), (diloco_line, "DiLoCo, H=10, overlap 5", "run-diloco")):
            shown = json.loads((out / run / "report.json").read_text())
            util = shown["utilization"]["share"]
            assert line.startswith(f"  {name}  {shown['samples']:>7,} samples  compute utilization {util:6.1%}  step "), line
            assert re.search(r" ms  across regions +[0-9.]+ [kMG]?B  \(" + re.escape(str(out / run)) + r"\)$", line), line
        bytes_across = [sum(x["bytes"] for x in json.loads((out / run / "wan.json").read_text())["links"]) for run in ("run", "run-diloco")]
        assert bytes_across[1] < bytes_across[0], bytes_across
        assert f"plot: {out / 'run-diloco' / 'report.png'} (per region: data wait, compute, gradient sync; the WAN's latencies)" in lines
    else:
        assert lines[1].startswith("WAN rehearsal off (")
        assert "two ways" not in stdout and not (out / "run-diloco").exists()
        assert f"plot: {out / 'run' / 'report.png'} (per region: data wait, compute, gradient sync)" in lines
    assert (out / "run" / "report.png").read_bytes().startswith(b"\x89PNG")
    assert any(
        line.startswith("training: one DDP job, 3 ranks (1 in us-east-1, 1 in eu-west-1, 1 in ap-southeast-1), 20 steps") for line in lines
    )
    assert "IO wait:" in stdout and ("within budget" in stdout or "over budget" in stdout)
    assert "regions" in [line.strip() for line in lines] and "across regions: data 0 B (goal 0)" in stdout
    report = json.loads((out / "run" / "report.json").read_text())
    assert report["steps"] == 20 and len(report["ranks"]) == 3 and 0 <= report["io_wait_share"] <= 1
    assert set(report["regions"]) == REGIONS
    assert report["cross_region_data_bytes"] == 0 and report["cross_region_grad_bytes"] > 0 and report["sync"] == "hierarchical"
    tiers = report["tiers"]
    for region in REGIONS:
        alluxio = tiers[f"alluxio:{region}"]
        assert alluxio["errors"] >= 1 and alluxio["hits"] == 0, "Alluxio is down: the chain falls back"
        assert tiers[f"s3:{region}"]["hits"] >= 1, "the cold replica is filled from the region's own bucket"
        assert any((out / "replica" / region).glob("*.tar")), "write-back filled the local replica"
    assert _processes_mentioning(str(out / "s3")) == [], "the S3 server is stopped"
    assert _processes_mentioning(str(out / "plan")) == [], "no rank is left"
    assert _namespaces_of(proc.pid) == [], "the rehearsal's namespaces are removed"


def test_side_by_side_lines_and_the_diloco_run_next_to_the_ddp_one(tmp_path: Path) -> None:
    from geoshard.local.demo import DemoResult, diloco_config, side_by_side
    from geoshard.trainer.config import TrainConfig

    ddp = TrainConfig(plan=tmp_path / "plan.toml", out=tmp_path / "run", steps=40)
    diloco = diloco_config(ddp)
    assert (diloco.out, diloco.sync, diloco.outer_steps, diloco.outer_overlap, diloco.steps) == (
        tmp_path / "run-diloco",
        "diloco",
        20,
        10,
        40,
    )

    def report(utilization: float, wall: float) -> dict:
        return {
            "steps": 40,
            "samples": 15_360,
            "world_size": 3,
            "utilization": {"share": utilization},
            "breakdown": {"wall": {"seconds": wall}},
        }

    for run, crossed in ((ddp.out, 44_700_000), (diloco.out, 5_400_000)):
        run.mkdir()
        (run / "wan.json").write_text(
            json.dumps({"links": [{"from": "a", "to": "b", "bytes": crossed - 1}, {"from": "b", "to": "a", "bytes": 1}]})
        )
    result = DemoResult(plan=None, split=None, report=report(0.439, 258.2), run_dir=ddp.out)  # type: ignore[arg-type]
    assert side_by_side(result) == []  # on loopback: one run, nothing to set beside it
    result.diloco, result.diloco_run_dir, result.outer_steps = report(0.567, 52.9), diloco.out, (20, 10)
    assert side_by_side(result) == [
        "the same corpus and 40 steps, two ways across the WAN rehearsal:",
        f"  hierarchical DDP           15,360 samples  compute utilization  43.9%  step  2152 ms  across regions   44.7 MB  ({ddp.out})",
        f"  DiLoCo, H=20, overlap 10   15,360 samples  compute utilization  56.7%  step   441 ms  across regions    5.4 MB  ({diloco.out})",
    ]
