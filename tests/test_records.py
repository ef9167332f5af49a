"""The typed records that cross modules: the loader's stats snapshot, the step record and the rank
summary, each through its one writer and its one reader; files of the version before records had
a version still read."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from geoshard.cli.train_progress import TrainProgress
from geoshard.errors import DataError
from geoshard.loaders.stats import LoaderStats, RegionPair, StatsSnapshot, TierSnapshot, merge
from geoshard.trainer.config import TrainConfig
from geoshard.trainer.loop import start_environment
from geoshard.trainer.record import StepRecord, append_step, parse_step, read_steps, write_steps
from geoshard.trainer.runlog import RunLogs
from geoshard.trainer.summary import LoaderSummary, RankSummary, read_summary, write_summary


def counted() -> StatsSnapshot:
    stats = LoaderStats()
    stats.hit("local:eu-west-1", 100, 0.5)
    stats.hit("local:eu-west-1", 50, 0.25)
    stats.count("local:eu-west-1", "misses")
    stats.add_egress("us-east-1", "eu-west-1", 7)
    stats.writeback()
    return stats.snapshot()


def test_snapshot_is_typed_and_its_wire_form_round_trips() -> None:
    snap = counted()
    assert snap.tiers["local:eu-west-1"] == TierSnapshot(hits=2, bytes=150, misses=1, fetch_seconds=0.75, fetch_seconds_max=0.5)
    assert snap.egress == {RegionPair("us-east-1", "eu-west-1"): 7} and snap.egress_total == 7 and snap.writebacks == 1
    wire = snap.to_dict()
    assert wire["version"] == 1 and wire["egress_bytes"] == {"us-east-1->eu-west-1": 7}
    assert wire["tiers"]["local:eu-west-1"]["fetch_seconds_mean"] == 0.375
    assert StatsSnapshot.from_dict(json.loads(json.dumps(wire))) == snap
    old = {k: v for k, v in wire.items() if k != "version"}  # written before the stats had a version
    assert StatsSnapshot.from_dict(old) == snap
    with pytest.raises(DataError, match="version 2"):
        StatsSnapshot.from_dict({**wire, "version": 2}, "rank0.json")
    with pytest.raises(DataError, match=r"rank0\.json: loader"):
        StatsSnapshot.from_dict({"egress_bytes": {"us-east-1": 7}}, "rank0.json")


def test_merge_adds_counts_and_keeps_maxima() -> None:
    other = LoaderStats()
    other.hit("local:eu-west-1", 10, 0.9)
    other.hit("s3:eu-west-1", 20, 0.1)
    other.add_egress("us-east-1", "eu-west-1", 3)
    m = merge([counted(), other.snapshot(), StatsSnapshot()])
    local = m.tiers["local:eu-west-1"]
    assert (local.hits, local.bytes, local.misses, local.fetch_seconds_max) == (3, 160, 1, 0.9)
    assert local.fetch_seconds == pytest.approx(1.65) and m.tiers["s3:eu-west-1"].hits == 1
    assert m.egress == {RegionPair("us-east-1", "eu-west-1"): 10} and m.writebacks == 1
    assert merge([]) == StatsSnapshot()


def test_writebacks_are_counted_under_the_lock() -> None:
    stats = LoaderStats()

    def count() -> None:
        for _ in range(20_000):
            stats.writeback()

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.snapshot().writebacks == 80_000


def test_step_records_one_writer_one_reader(tmp_path: Path) -> None:
    path = tmp_path / "steps-rank1.jsonl"
    records = [StepRecord(step=i, rank=1, t=i + 1.0, data_wait_s=0.1, compute_s=0.8, step_s=0.9, loss=2.0, samples=4) for i in range(3)]
    write_steps(path, records[:2])
    with path.open("a") as f:
        append_step(f, records[2])
        f.write('{"step": 3, "ra')  # a rank killed mid-write
    assert read_steps(path, 1) == records
    assert json.loads(path.read_text().splitlines()[0])["version"] == 1
    old = '{"step": 7, "t": 1.5, "data_wait_s": 0.5, "compute_s": 1, "step_s": 1.5}'  # no version: 1
    assert parse_step(old, "x", 0) == StepRecord(step=7, rank=0, t=1.5, data_wait_s=0.5, compute_s=1.0, step_s=1.5)
    with pytest.raises(DataError, match="x:3: a step record of version 9"):
        parse_step(json.dumps({**records[0].to_json(), "version": 9}), "x:3", 1)
    with pytest.raises(DataError, match="rank 1 in the file of rank 0"):
        parse_step(json.dumps(records[0].to_json()), "x", 0)


def test_rank_summary_one_writer_one_reader(tmp_path: Path) -> None:
    loader = LoaderSummary(counted(), dropped_samples=3, padded_samples=1, epoch=2)
    earlier = RankSummary(rank=1, world_size=2, region="eu-west-1", wall_s=1.0, steps=4, samples=16, loader=loader, segment=0)
    summary = dataclasses.replace(earlier, wall_s=2.0, segment=1, backend="gloo", sync="flat", earlier_segments=(earlier,))
    path = write_summary(tmp_path, summary)
    assert path.name == "rank1.json" and read_summary(path, 1) == summary
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["loader"]["dropped_samples"] == 3 and doc["loader"]["egress_bytes"] == {"us-east-1->eu-west-1": 7}
    # A summary of an older version: no version, no segment; fields of another type are left out.
    old = {"rank": 1, "wall_s": 3, "region": 5, "steps": 2, "loader": {"tiers": {}, "egress_bytes": {}, "writebacks": 0}}
    path.write_text(json.dumps(old))
    got = read_summary(path, 1)
    assert (got.wall_s, got.region, got.steps, got.segment) == (3, None, 2, None)
    assert got.loader == LoaderSummary(StatsSnapshot())
    path.write_text(json.dumps({**old, "rank": 0}))
    with pytest.raises(DataError, match=r"rank1\.json: rank 0 in the file of rank 1"):
        read_summary(path, 1)


def test_run_logs_resume_trims_and_carries_segments(tmp_path: Path) -> None:
    logs = RunLogs(tmp_path, 0)
    assert logs.start_segment(0) == 0
    with logs.open_steps() as f:
        for i in range(1, 6):
            append_step(f, StepRecord(step=i, rank=0, t=float(i), data_wait_s=0.0, compute_s=1.0, step_s=1.0))
    first = logs.finish(RankSummary(rank=0, wall_s=5.0), 0)
    assert first.earlier_segments == () and logs.last_step() == 5
    assert logs.start_segment(3) == 1  # a resume at step 3: steps 4 and 5 are redone
    assert [r.step for r in read_steps(logs.steps, 0)] == [1, 2, 3]
    second = logs.finish(RankSummary(rank=0, wall_s=2.0), 1)
    assert second.earlier_segments == (dataclasses.replace(first, earlier_segments=None),)
    assert read_summary(tmp_path / "rank0.json", 0) == second


def test_network_variables_are_given_at_start_not_set_in_place(tmp_path: Path) -> None:
    cfg = TrainConfig(plan=tmp_path / "plan.toml", out=tmp_path / "run", steps=1, nccl_algo="Tree", socket_ifname="eth1")
    env = start_environment(cfg, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "NCCL_ALGO": "Tree", "NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"}
    assert start_environment(cfg, env) is None
    assert start_environment(TrainConfig(plan=cfg.plan, out=cfg.out, steps=1), {"PATH": "/bin"}) is None


def test_train_progress_reads_step_records(tmp_path: Path) -> None:
    old = tmp_path / "steps-rank0.jsonl"
    write_steps(old, [StepRecord(step=1, rank=0, t=1.0, data_wait_s=0.5, compute_s=0.5, step_s=1.0, loss=9.0)])
    progress = TrainProgress(tmp_path, steps=10)  # the earlier segment's record is not this run's
    with old.open("a") as f:
        append_step(f, StepRecord(step=2, rank=0, t=1.0, data_wait_s=0.25, compute_s=0.75, step_s=1.0, loss=1.5, samples=8, segment=1))
        f.write("not json\n")
    write_steps(
        tmp_path / "steps-rank1.jsonl", [StepRecord(step=2, rank=1, t=1.0, data_wait_s=0.25, compute_s=0.75, step_s=1.0, samples=8)]
    )
    progress.poll()
    assert (progress.step, progress.loss) == (2, 1.5)
    assert progress.window == {"samples": 16, "wait": 0.5, "busy": 2.0}
    assert progress.line(2.0) == "step 2/10  loss 1.5  8 samples/s  data wait 25.0%"
