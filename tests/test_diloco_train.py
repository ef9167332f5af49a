"""``geoshard train --regions ... --sync diloco`` as a user runs it: each region a torchrun job of
its own, DDP inside the region, outer rounds peer to peer (the default transport; the store the
launcher hosts for membership); a region lost
mid-run (agent, ranks and loader workers SIGKILLed, as in a spot reclaim) is started again and
rejoins while the others never restart; every sample of every region is consumed exactly once per
epoch; the report shows the rounds, each region's losses and the compute utilization."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from killkit import run_and_kill
from splitkit import make_corpus
from synckit import cli
from test_loaders import region_samples

from geoshard.manifest import read_region_manifest

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
US, EU, AP = "us-east-1", "eu-west-1", "ap-southeast-1"
FLAGS = ("--batch-size", 16, "--num-workers", 1, "--backend", "gloo", "--log-keys", "--sync", "diloco")


INNER = ("one rank in the region, no DDP", "DDP in the region")  # the start-up line, by region size


def local_plan(tmp: Path, weights: dict[str, int], samples: int) -> Path:
    """The regions' data in local replicas (the split's own folders)."""
    make_corpus(tmp / "corpus", samples=samples, sample_bytes=300, shard_samples=200)
    lines = ['[shards]\nbytes = "40KB"']
    lines += [f'[regions.{r}]\nweight = {w}\nlocal = "{tmp / "split" / r}"' for r, w in weights.items()]
    plan = tmp / "plan.toml"
    plan.write_text("\n".join(lines) + "\n")
    r = cli("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.exit_code == 0, r.output
    return plan


def train_argv(plan: Path, out: Path, regions: str, *args: object) -> list[str]:
    return [GEOSHARD, "train", "--plan", str(plan), "--regions", regions, "--out", str(out), *map(str, FLAGS), *map(str, args)]


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_diloco_without_regions_is_one_line(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[regions.{US}]\nbucket = "s3://b/p"\n')
    argv = [GEOSHARD, "train", "--plan", str(plan), "--region", US, "--out", str(tmp_path / "run"), "--steps", "5", "--sync", "diloco"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "geoshard: error: --sync diloco needs --regions (one torchrun per region); with your own torchrun per region, run "
        "python -m geoshard.trainer with --outer-store and --outer-regions (docs/diloco.md)"
    ]
    bad = train_argv(plan, tmp_path / "run", f"{US}:1", "--steps", 5, "--outer-momentum", 1)
    done = subprocess.run(bad, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.strip() == "geoshard: error: --outer-momentum must be at least 0 and below 1, got 1.0"


@pytest.mark.slow
def test_diloco_trains_each_region_alone_between_rounds_and_the_loss_goes_down(tmp_path: Path) -> None:
    plan = local_plan(tmp_path, {US: 2, EU: 1}, samples=3000)
    out = tmp_path / "run"
    steps, h = 60, 10
    argv = train_argv(plan, out, f"{US}:2,{EU}:1", "--steps", steps, "--outer-steps", h, "--lr", 0.05, "--hidden", 256)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for region, n in ((US, 2), (EU, 1)):
        assert (
            f"geoshard.trainer: {region}: {n} of the job's 3 rank(s); {INNER[n > 1]}, DiLoCo across {US}:2,{EU}:1 "
            f"every {h} steps (outer lr 0.7, momentum 0.9, Nesterov, fp16; peer to peer, sharded over every rank, 8 streams)"
        ) in done.stdout  # the default transport
    report = json.loads((out / "report.json").read_text())
    assert report["sync"] == "diloco" and report["world_size"] == 3 and report["complete"]
    assert report["loss_last"] < report["loss_first"] - 0.05, (report["loss_first"], report["loss_last"])
    outer = report["outer"]
    assert [r["round"] for r in outer["rounds"]] == list(range(1, steps // h + 1))
    for r in outer["rounds"]:
        assert r["regions"] == [US, EU] and r["missing"] == [] and r["bytes"] > 0 and r["sync_s"] >= 0
    assert outer["regions"][US] == outer["regions"][EU] == {"rounds": 6, "rounds_missed": 0, "adopted": 0, "joins": 1, "steps_lost": 0}
    # Nothing crosses regions between rounds: DDP stays inside the region, the data too.
    assert report["cross_region_grad_bytes"] == 0 and report["cross_region_data_bytes"] == 0
    u = report["utilization"]
    assert 0 < u["share"] < 1 and u["target"] == 0.95 and u["met"] == (u["share"] >= 0.95)
    for text in ("DiLoCo outer rounds", "DiLoCo per region", "6 round(s), sync", "compute utilization"):
        assert text in done.stdout, text
    # Each region's checkpoints apart, with the outer loop's state.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [EU, US]


def region_pids(out: Path, region: str) -> list[int]:
    """Every process of ``region``'s part of the run in ``out``: agent, rank, loader workers."""
    want = f"\0GEOSHARD_REGION={region}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if want in b"\0" + (entry / "environ").read_bytes() and str(out).encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
    return pids


def last_step(out: Path, rank: int) -> int:
    path = out / f"steps-rank{rank}.jsonl"
    best = 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                best = max(best, int(json.loads(line)["step"]))
    return best


@pytest.mark.slow
def test_a_lost_region_rejoins_while_the_others_never_restart_and_every_sample_is_read_once(tmp_path: Path) -> None:
    plan = local_plan(tmp_path, {US: 1, EU: 1, AP: 1}, samples=2400)
    split = tmp_path / "split"
    counts = {r: sum(s.samples for s in read_region_manifest(split / r).shards) for r in (US, EU, AP)}
    steps = min(counts.values()) // 16  # one epoch of full batches in every region
    every = 5
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    argv = train_argv(plan, out, f"{US}:1,{EU}:1,{AP}:1", "--steps", steps, "--outer-steps", every, "--checkpoint-every", every)
    # A round waits 3 s for a missing region; a restart takes longer, so eu-west-1 misses rounds.
    argv += ["--outer-timeout", "3", "--max-restarts", "1", "--step-time", "0.15", "--hidden", "256"]

    def eu_region() -> tuple[int, list[int]] | None:  # a spot reclaim: the agent, the rank and its loader worker at once
        seen = last_step(out, 1)  # eu-west-1 is the job's rank 1
        return (seen, region_pids(out, EU)) if every + 2 <= seen < steps - 2 * every else None

    code, killed_at = run_and_kill(argv, log, tmp_path, eu_region)
    text = log.read_text()
    assert code == 0, text[-5000:]
    assert f"geoshard: region {EU} stopped (exit -9); starting it again" in text, text[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["complete"]
    # The others never restarted: one segment each, one join each, and their rounds follow on.
    for rank, region in ((0, US), (2, AP)):
        assert {x["segment"] for x in lines(out / f"steps-rank{rank}.jsonl")} == {0}, region
        rounds = lines(out / f"rounds-{region}.jsonl")
        assert [x["event"] for x in rounds].count("join") == 1, region
        assert not any(x.get("adopted") for x in rounds), region
    eu = lines(out / f"rounds-{EU}.jsonl")
    joins = [x for x in eu if x["event"] == "join"]
    assert len(joins) == 2 and joins[1]["step"] >= every and joins[1]["step"] % every == 0
    assert joins[1]["steps_lost"] >= killed_at - joins[1]["step"] > 0  # it redid the steps after its checkpoint
    g = report["outer"]["regions"][EU]
    assert g["joins"] == 2 and g["steps_lost"] == sum(x["steps_lost"] for x in eu)
    assert report["outer"]["regions"][US]["steps_lost"] == 0 and report["outer"]["regions"][AP]["steps_lost"] == 0
    # Each round closed while eu-west-1 was away averaged the regions present, and counts as missed by it.
    away = [r for r in report["outer"]["rounds"] if EU in r["missing"]]
    assert g["rounds_missed"] == len(away) >= 1, report["outer"]
    # It came back from the newest state published when it joined: one published without it, or (a
    # restart quicker than the round's wait) the one before, whose next round closed while it redid steps.
    assert joins[1]["round"] >= away[0]["round"] - 1, (joins[1], away[0])
    assert all(set(r["regions"]) <= {US, AP} and r["regions"] for r in away)
    # Every sample of every region exactly once in the epoch, the restarted region included.
    for rank, region in ((0, US), (1, EU), (2, AP)):
        logged = lines(out / f"keys-rank{rank}.jsonl")
        assert [x["step"] for x in logged] == list(range(1, steps + 1)), region
        keys = Counter(k for x in logged for k in x["keys"])
        region_keys = {s["__key__"] for s in region_samples(split / region, "wds")}
        assert max(keys.values()) == 1 and set(keys) <= region_keys and len(keys) == steps * 16, region
    assert "DiLoCo per region" in text and "steps lost" in text
