"""One job across regions: each region's samples go to that region's ranks only, every rank yields
the same count, what an epoch leaves out rotates; hierarchical gradient sync agrees with flat;
``geoshard train --regions`` runs one torchrun agent per region against SeaweedFS buckets and local
replicas, reads nothing across regions, and survives a killed rank with every sample of the
epoch consumed exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from killkit import run_and_kill
from servers import SeaweedS3
from splitkit import make_corpus
from synckit import cli
from test_loaders import region_samples

from geoshard.loaders import RegionalDataset
from geoshard.loaders.balance import balance
from geoshard.loaders.topology import Topology
from geoshard.manifest import read_region_manifest

ROOT = Path(__file__).resolve().parents[1]
GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
US, EU, AP = "us-east-1", "eu-west-1", "ap-southeast-1"


def two_region_plan(tmp: Path, samples: int = 3000) -> Path:
    """The case measured on main: us-east-1 weight 2, eu-west-1 weight 1, local replicas."""
    make_corpus(tmp / "corpus", samples=samples, sample_bytes=200, shard_samples=250)
    plan = tmp / "plan.toml"
    plan.write_text(
        f'[shards]\nbytes = "40KB"\n[regions.{US}]\nweight = 2\nlocal = "{tmp / "split" / US}"\n'
        f'[regions.{EU}]\nweight = 1\nlocal = "{tmp / "split" / EU}"\n'
    )
    r = cli("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.exit_code == 0, r.output
    return plan


def totals(split: Path, regions: list[str]) -> dict[str, int]:
    return {r: sum(s.samples for s in read_region_manifest(split / r).shards) for r in regions}


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_region_is_read_by_its_own_ranks_with_equal_counts_and_rotating_left_outs(tmp_path: Path, shuffle: bool) -> None:
    plan = two_region_plan(tmp_path)
    counts = totals(tmp_path / "split", [US, EU])
    assert counts[US] > 1.5 * counts[EU] and sum(counts.values()) == 3000
    layout = [US, US, EU]  # ranks 0 and 1 in us-east-1, rank 2 in eu-west-1
    bal = balance(counts, {US: 2, EU: 1})
    assert bal.samples_per_rank == min(counts[US] // 2, counts[EU])
    left = {r: bal.region(r).left_out for r in (US, EU)}
    assert sum(left.values()) > 0 and f"{US} {counts[US] - left[US]} of {counts[US]} ({left[US]} left out)" in bal.line()
    want = {r: Counter(s["__key__"] for s in region_samples(tmp_path / "split" / r, "wds")) for r in (US, EU)}
    seen: dict[str, Counter[str]] = {US: Counter(), EU: Counter()}
    epochs = 3
    for epoch in range(epochs):
        per_epoch: dict[str, Counter[str]] = {US: Counter(), EU: Counter()}
        lengths = []
        for rank, region in enumerate(layout):
            ds = RegionalDataset(plan, topology=Topology.of(layout, rank), samples_per_rank=bal.samples_per_rank, shuffle=shuffle, seed=5)
            assert ds.region == region and len(ds) == bal.samples_per_rank
            ds.set_epoch(epoch)
            keys = [x["__key__"] for x in ds]
            lengths.append(len(keys))
            per_epoch[region].update(keys)
        assert lengths == [bal.samples_per_rank] * 3, "every rank of the job yields the same count"
        for r in (US, EU):
            assert set(per_epoch[r]) <= set(want[r]), "a rank read another region's samples"
            assert max(per_epoch[r].values()) == 1, "a sample twice in one epoch"
            assert len(per_epoch[r]) == counts[r] - left[r], "the epoch reads the region minus what the start-up line said"
            seen[r].update(per_epoch[r])
    for r in (US, EU):
        assert set(seen[r]) == set(want[r]), "after 3 epochs no sample is lost for good"
        assert set(seen[r].values()) <= {epochs - 1, epochs}, Counter(seen[r].values())


def test_a_spanning_topology_without_a_job_figure_and_a_region_mismatch_are_config_errors(tmp_path: Path) -> None:
    from geoshard.errors import ConfigError

    plan = two_region_plan(tmp_path, samples=600)
    with pytest.raises(ConfigError, match="samples_per_rank"):
        RegionalDataset(plan, topology=Topology.of([US, EU], 1))
    with pytest.raises(ConfigError, match="topology puts it in eu-west-1"):
        RegionalDataset(plan, region=US, topology=Topology.of([US, EU], 1), samples_per_rank=10)


def torchrun(script: Path, nproc: int, *args: object, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1"]
    argv += ["--master-port", str(_port()), str(script), *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=script.parent, check=False)


def _port() -> int:
    from servers import free_ports

    return int(free_ports(1)[0])


def test_a_dataset_in_a_job_that_spans_regions_without_its_region_group_is_one_line(tmp_path: Path) -> None:
    plan = two_region_plan(tmp_path, samples=600)
    script = tmp_path / "span.py"
    script.write_text(
        "import sys\nimport torch.distributed as dist\nfrom geoshard.loaders import RegionalDataset\n"
        "from geoshard.errors import ConfigError\n"
        "dist.init_process_group('gloo')\n"
        f"region = {US!r} if dist.get_rank() == 0 else {EU!r}\n"
        "out = open(f'{sys.argv[2]}/rank{dist.get_rank()}.txt', 'w')\n"
        "try:\n    RegionalDataset(sys.argv[1], region=region)\n"
        "except ConfigError as e:\n    out.write(f'rank {dist.get_rank()}: {e}\\n')\n"
        "else:\n    out.write('no error\\n')\n"
        "dist.destroy_process_group()\n"
    )
    done = torchrun(script, 2, plan, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert all(line.count("\n") == 1 for line in lines), lines
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank}: this job's ranks span regions (us-east-1: 1 rank(s), eu-west-1: 1 rank(s)): pass topology=")
    assert "Traceback" not in done.stdout


def test_hierarchical_sync_gives_the_parameters_of_flat_sync_with_fewer_cross_region_bytes(tmp_path: Path) -> None:
    out = tmp_path / "sync.json"
    done = torchrun(ROOT / "tests" / "jobs" / "sync_compare.py", 4, out, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    res, params = data["results"], data["params"]
    for name, r in res.items():
        assert r["ranks_agree"], name
        if name.startswith("none"):
            # fp32: the same sums in another order (in-region first): rounding only.
            assert r["max_abs_diff"] <= 1e-6, (name, r)
        else:
            # fp16 on every hop (flat) vs the cross-region hop only (hierarchical): within fp16 rounding.
            assert 0 < r["max_abs_diff"] <= 1e-3 * r["param_scale"], (name, r)
    # Per step each of the 3 region leaders sends 2*(3-1)/3 of the gradient (ring model).
    for name, r in res.items():
        width = 2 if name.startswith("fp16") else 4
        assert r["hier_cross_bytes"] == data["steps"] * 3 * (2 * 2 * params * width // 3), (name, r)
        assert r["hier_cross_bytes"] < r["flat_cross_bytes"], (name, r)
    assert res["fp16-accum1"]["hier_cross_bytes"] * 2 == res["none-accum1"]["hier_cross_bytes"]


# -- geoshard train --regions ----------------------------------------------------------------------


def bucket_plan(tmp: Path, server: SeaweedS3, samples: int = 3000) -> Path:
    """Three regions, each with its own SeaweedFS bucket and an (empty) local replica."""
    make_corpus(tmp / "corpus", samples=samples, sample_bytes=300, shard_samples=200)
    tag = f"mr{time.time_ns() % 10**8}"
    lines = ['[shards]\nbytes = "40KB"']
    for r, w in ((US, 2), (EU, 1), (AP, 1)):
        lines.append(
            f'[regions.{r}]\nweight = {w}\nbucket = "s3://{tag}-{r}/train"\nendpoint = "{server.endpoint}"\nlocal = "{tmp / "replica" / r}"'
        )
    plan = tmp / "plan.toml"
    plan.write_text("\n".join(lines) + "\n")
    r = cli("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.exit_code == 0, r.output
    r = cli("sync", tmp / "split", "--plan", plan, "--create-buckets")
    assert r.exit_code == 0, r.output
    return plan


TRAIN_FLAGS = ("--batch-size", 16, "--num-workers", 1, "--backend", "gloo", "--log-keys", "--no-allow-cross-region")


def geoshard_train(plan: Path, out: Path, regions: str, *args: object) -> list[str]:
    return [GEOSHARD, "train", "--plan", str(plan), "--regions", regions, "--out", str(out), *map(str, TRAIN_FLAGS), *map(str, args)]


def run_train(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``geoshard train`` to the end, as a user runs it; it must succeed."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def key_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_geoshard_train_across_three_regions_reads_only_region_local_data(aws: SeaweedS3, tmp_path: Path) -> None:
    plan = bucket_plan(tmp_path, aws)
    out = tmp_path / "run"
    steps = 30
    done = run_train(geoshard_train(plan, out, f"{US}:2,{EU}:1,{AP}:1", "--steps", steps, "--hidden", 256, "--lr", 0.1), tmp_path)
    assert "geoshard.trainer: 4 rank(s): " in done.stdout and "gradient sync hierarchical" in done.stdout
    assert "samples per rank and epoch; per epoch us-east-1 " in done.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 4 and report["complete"] and report["sync"] == "hierarchical"
    assert set(report["regions"]) == {US, EU, AP} and [report["regions"][r]["ranks"] for r in (US, EU, AP)] == [2, 1, 1]
    assert report["cross_region_data_bytes"] == 0 and report["egress_bytes"] == {}
    assert report["cross_region_grad_bytes"] > 0 and report["cross_region_grad_bytes_per_step"] > 0
    assert report["loss_last"] < report["loss_first"]
    split = tmp_path / "split"
    region_keys = {r: {s["__key__"] for s in region_samples(split / r, "wds")} for r in (US, EU, AP)}
    for rank_report in report["ranks"]:
        rank, region = rank_report["rank"], rank_report["region"]
        assert rank_report["steps"] == steps
        logged = key_records(out / f"keys-rank{rank}.jsonl")
        keys = {k for rec in logged for k in rec["keys"]}
        assert keys <= region_keys[region], f"rank {rank} read outside {region}"
        tiers = json.loads((out / f"rank{rank}.json").read_text())["loader"]["tiers"]
        assert set(tiers) <= {f"s3:{region}", f"local:{region}"}, tiers
    for r in (US, EU, AP):
        g = report["regions"][r]
        assert g["left_out_per_epoch"] == g["region_samples"] - g["samples_per_epoch"] >= 0
        assert 0 <= g["io_wait_share"] <= 1 and g["time_to_first_batch_s"] is not None
    # The table a user sees shows the regions and what crossed them.
    assert "regions" in done.stdout and "across regions: data 0 B (goal 0)" in done.stdout


def trainer_pid(out: Path, region: str) -> int | None:
    """The trainer process of ``region`` in the run writing to ``out`` (a torchrun agent's child, not a DataLoader worker)."""
    want = f"\0GEOSHARD_REGION={region}\0".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            if b"geoshard.trainer" not in cmd or str(out).encode() not in cmd or b"torch.distributed.run" in cmd:
                continue
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if (
                b"torch.distributed.run" in Path(f"/proc/{parent}/cmdline").read_bytes()
                and want in b"\0" + (entry / "environ").read_bytes()
            ):
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


@pytest.mark.slow
def test_a_killed_rank_in_one_region_resumes_and_every_sample_of_the_epoch_is_read_once(aws: SeaweedS3, tmp_path: Path) -> None:
    plan = bucket_plan(tmp_path, aws, samples=2400)
    split = tmp_path / "split"
    counts = totals(split, [US, EU, AP])
    per_rank = balance(counts, {US: 1, EU: 1, AP: 1}).samples_per_rank
    steps = per_rank // 16  # one epoch of full batches
    every = 5
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    argv = geoshard_train(plan, out, f"{US}:1,{EU}:1,{AP}:1", "--steps", steps, "--checkpoint-every", every)
    argv += ["--resume", "--max-restarts", "1", "--hidden", "1024"]

    def eu_rank() -> tuple[int, list[int]] | None:
        pid, seen = trainer_pid(out, EU), _last_step(out, EU)
        return (seen, [pid]) if pid is not None and every + 2 <= seen < steps - every else None

    code, _ = run_and_kill(argv, log, tmp_path, eu_rank, timeout=300)
    text = log.read_text()
    assert code == 0, text[-5000:]
    assert text.count("resumed at step") == 3, text[-3000:]  # every rank restarted from the checkpoint
    report = json.loads((out / "report.json").read_text())
    for r in (US, EU, AP):
        keys: Counter[str] = Counter()
        for rank in report["regions"][r]["global_ranks"]:
            logged = key_records(out / f"keys-rank{rank}.jsonl")
            assert [x["step"] for x in logged] == list(range(1, steps + 1))
            keys.update(k for x in logged for k in x["keys"])
        region = {s["__key__"] for s in region_samples(split / r, "wds")}
        assert max(keys.values()) == 1 and set(keys) <= region and len(keys) == steps * 16, r


def _last_step(out: Path, region: str) -> int:
    """The newest step any rank of ``region`` logged (their files name the rank, the records the region)."""
    best = 0
    for p in out.glob("steps-rank*.jsonl"):
        with contextlib.suppress(OSError):
            for line in p.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if rec.get("region") == region:
                        best = max(best, int(rec["step"]))
    return best


# -- under the WAN rehearsal ------------------------------------------------------------------------


def test_wan_without_regions_is_one_line(tmp_path: Path) -> None:
    plan = two_region_plan(tmp_path, samples=600)
    (tmp_path / "m.toml").write_text('[[link]]\na = "us-east-1"\nb = "eu-west-1"\nlatency_ms = 10\n')
    done = subprocess.run(
        [
            GEOSHARD,
            "train",
            "--plan",
            str(plan),
            "--region",
            US,
            "--steps",
            "2",
            "--out",
            str(tmp_path / "run"),
            "--wan",
            str(tmp_path / "m.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "geoshard: error: --wan needs --regions (the ranks per region to put in each region's namespace)"
    ]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN rehearsal needs root (CAP_NET_ADMIN)")
def test_geoshard_train_under_the_wan_rehearsal_keeps_data_in_region_and_pays_the_round_trips(aws: SeaweedS3, tmp_path: Path) -> None:
    plan = bucket_plan(tmp_path, aws, samples=1500)
    matrix = tmp_path / "wan.toml"
    links = ((US, EU, 38), (US, AP, 110), (EU, AP, 85))
    matrix.write_text("".join(f'[[link]]\na = "{a}"\nb = "{b}"\nlatency_ms = {ms}\nbandwidth_mbit = 200\n\n' for a, b, ms in links))
    out = tmp_path / "run"
    steps = 6
    done = run_train(geoshard_train(plan, out, f"{US}:1,{EU}:1,{AP}:1", "--steps", steps, "--hidden", 64, "--wan", matrix), tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"WAN rehearsal: {US}, {EU}, {AP} in their own network namespaces behind {matrix}; forwarder ceiling: ")
    assert any(line.startswith("WAN rehearsal: ") and "MB crossed between regions" in line for line in lines)
    # Each region's bucket is served from its own namespace's address.
    wan_plan = (out / "plan-wan.toml").read_text()
    assert wan_plan.count('endpoint = "http://198.18.') == 3 and "127.0.0.1" not in wan_plan.replace("alluxio", "")
    report = json.loads((out / "report.json").read_text())
    assert report["cross_region_data_bytes"] == 0 and report["steps"] == steps and report["sync"] == "hierarchical"
    # The leaders' all-reduce crosses links of 76-220 ms round trip: a ring of 3 takes 4 sequential
    # exchanges, so each step's cross-region hop takes well over one 38 ms one-way delay.
    assert report["grad_sync_cross_s_per_step"] > 0.076, report["grad_sync_cross_s_per_step"]
    crossed = json.loads((out / "wan.json").read_text())
    assert all(x["bytes"] > 0 for x in crossed["links"]) and len(crossed["links"]) == 6
    from geoshard.wan import netns

    left = [n for n in netns.list_namespaces() if not netns.pid_alive(netns.owner_of(n) or 0)]
    assert left == [], "the rehearsal's namespaces outlived their launcher"


def test_persistent_workers_are_refused_because_each_epoch_starts_its_own_workers(tmp_path: Path) -> None:
    from geoshard.errors import ConfigError
    from geoshard.loaders import RegionalLoader

    plan = two_region_plan(tmp_path, samples=600)
    ds = RegionalDataset(plan, region=EU, batch_size=8)
    with pytest.raises(ConfigError, match="persistent_workers is not supported"):
        RegionalLoader(ds, num_workers=2, persistent_workers=True)
    loader = RegionalLoader(ds, num_workers=2)
    first = [k for b in loader for k in b["__key__"]]
    loader.set_epoch(1)
    second = [k for b in loader for k in b["__key__"]]
    assert sorted(first) == sorted(second) and first != second, "each epoch's workers start at that epoch"
