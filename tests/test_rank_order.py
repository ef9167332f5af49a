"""A flat job across regions numbers its ranks by the job's region order and each rank's place in
its region, whatever order torchrun's agents met in: two launches of one job give the same
per-step losses and read the same keys under the same rank numbers (trainer/rankorder.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_diloco_train import local_plan

from geoshard.errors import ConfigError
from geoshard.trainer.config import parse_regions
from geoshard.trainer.rankorder import job_rank, job_rank_from

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
US, EU = "us-east-1", "eu-west-1"
REGIONS = f"{US}:1,{EU}:2"
ARGS = ("--steps", 30, "--batch-size", 16, "--num-workers", 1, "--backend", "gloo", "--log-keys", "--hidden", 64)

# The same job launched with eu-west-1's agent on 127.0.0.1 and us-east-1's on 127.0.0.2: c10d's
# rendezvous sorts agents by address, so torchrun hands eu-west-1's ranks the numbers 0 and 1.
REVERSED = """
import sys
from pathlib import Path
from geoshard.trainer.config import TrainConfig, parse_regions
from geoshard.trainer.launch import RegionNet, launch_regions
addr = {"us-east-1": "127.0.0.2", "eu-west-1": "127.0.0.1"}
cfg = TrainConfig(plan=Path(sys.argv[1]), out=Path(sys.argv[2]), steps=30, batch_size=16, num_workers=1, backend="gloo",
                  log_keys=True, hidden=64)
sys.exit(launch_regions(cfg, parse_regions(sys.argv[3]), net=RegionNet(address=addr.__getitem__)))
"""


def test_job_rank_is_the_region_offset_plus_the_local_rank_and_a_mismatch_is_one_line() -> None:
    order = parse_regions(REGIONS)
    assert [job_rank(order, US, 0, 1, 3), job_rank(order, EU, 0, 2, 3), job_rank(order, EU, 1, 2, 3)] == [0, 1, 2]
    cases = [
        ((order, "ap-southeast-1", 0, 1, 3), f"--rank-order {REGIONS}: this rank's region ap-southeast-1 is not one of them"),
        ((order, US, 0, 1, 4), f"--rank-order {REGIONS} counts 3 rank(s); torchrun started 4"),
        (
            (order, EU, 0, 1, 3),
            f"--rank-order {REGIONS} gives {EU} 2 rank(s); its torchrun agent has 1 "
            "(one agent per region: leave --rank-order out with several agents in a region)",
        ),
    ]
    for args, message in cases:
        with pytest.raises(ConfigError) as e:
            job_rank(*args)
        assert e.value.message == message
    env = {"GEOSHARD_REGION": EU, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert job_rank_from(order, None, env, 3) == 2 and job_rank_from(order, US, {**env, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}, 3) == 0
    with pytest.raises(ConfigError, match="run the trainer under torchrun: 'LOCAL_WORLD_SIZE' is missing"):
        job_rank_from(order, EU, {"LOCAL_RANK": "0"}, 3)


def records(path: Path, fields: tuple[str, ...]) -> list[tuple[Any, ...]]:
    return [tuple(rec[f] for f in fields) for rec in map(json.loads, path.read_text().splitlines())]


def per_rank(out: Path) -> dict[int, tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]]:
    """Each rank's (step, region, loss) and (step, region, keys), by the rank number in the file name."""
    steps, keys = ("step", "region", "loss"), ("step", "region", "keys")
    return {r: (records(out / f"steps-rank{r}.jsonl", steps), records(out / f"keys-rank{r}.jsonl", keys)) for r in range(3)}


@pytest.mark.slow
def test_two_launches_of_one_flat_job_give_the_same_losses_and_keys_whatever_order_the_agents_met_in(tmp_path: Path) -> None:
    plan = local_plan(tmp_path, {US: 2, EU: 1}, samples=3000)
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        argv = [GEOSHARD, "train", "--plan", str(plan), "--regions", REGIONS, "--out", str(out), *map(str, ARGS)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"geoshard.trainer: 3 rank(s): {US}: 1 rank(s), {EU}: 2 rank(s); gradient sync hierarchical" in done.stdout
        runs.append(out)
    out = tmp_path / "reversed"
    done = subprocess.run(
        [sys.executable, "-P", "-c", REVERSED, str(plan), str(out), REGIONS], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs.append(out)
    first = per_rank(runs[0])
    # Rank 0 is us-east-1's, ranks 1 and 2 eu-west-1's, in every launch.
    assert [first[r][0][0][1] for r in range(3)] == [US, EU, EU] and all(len(first[r][0]) == 30 for r in range(3))
    for other in runs[1:]:
        assert per_rank(other) == first, other.name
        report = json.loads((other / "report.json").read_text())
        assert report["regions"][US]["global_ranks"] == [0] and report["regions"][EU]["global_ranks"] == [1, 2]
    # The ranks read different data and trained: the comparison above is not of empty or equal lists.
    assert first[1][1] != first[2][1] and first[0][0][-1][2] != first[0][0][0][2]
