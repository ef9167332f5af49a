"""DiLoCo's peer-to-peer outer exchange (trainer/diloco/: shards, ring, groups, sharded, mac, p2p):
bulk bytes over gloo between the regions' ranks, sharded over every rank, the store for
membership and rendezvous only. Real processes on 127.0.0.1 around a TCPStore this test hosts."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from geoshard.trainer.diloco import host_store
from geoshard.trainer.diloco.groups import CountingStore
from geoshard.trainer.diloco.ring import ring_order
from geoshard.trainer.diloco.shards import Layout, owned, shard_count, span
from geoshard.wan.matrix import parse_matrix

ROOT = Path(__file__).resolve().parent.parent
RANK_JOB = ROOT / "tests" / "jobs" / "p2p_rank.py"


INNER = ("one rank in the region, no DDP", "DDP in the region")  # the start-up line, by region size


def test_every_shard_has_exactly_one_owner_in_every_region_also_with_unequal_rank_counts() -> None:
    ranks = {"us-east-1": 3, "eu-west-1": 2, "ap-southeast-1": 1}
    s = shard_count(list(ranks.values()))
    assert s == 3
    assert owned(0, 2, s) == (0, 2) and owned(1, 2, s) == (1,) and owned(0, 1, s) == (0, 1, 2)
    for n in ranks.values():
        mine = [sh for k in range(n) for sh in owned(k, n, s)]
        assert sorted(mine) == list(range(s))  # each shard once per region
    numel = 10
    spans = [span(numel, s, i) for i in range(s)]
    assert spans == [(0, 4), (4, 7), (7, 10)]  # contiguous, cover the vector, sizes differ by at most one
    assert Layout(numel, s, 2, 0).own_numel == 7 and Layout(numel, s, 2, 1).own_numel == 3
    assert sum(Layout(numel, s, 3, k).own_numel for k in range(3)) == numel


MATRIX = """
[[link]]
a = "us-east-1"
b = "eu-west-1"
latency_ms = 38
bandwidth_mbit = 200
[[link]]
a = "us-east-1"
b = "ap-southeast-1"
latency_ms = 110
bandwidth_mbit = 100
[[link]]
a = "us-east-1"
b = "sa-east-1"
latency_ms = 60
bandwidth_mbit = 400
[[link]]
a = "eu-west-1"
b = "ap-southeast-1"
latency_ms = 85
bandwidth_mbit = 400
[[link]]
a = "eu-west-1"
b = "sa-east-1"
latency_ms = 90
bandwidth_mbit = 20
[[link]]
a = "ap-southeast-1"
b = "sa-east-1"
latency_ms = 150
bandwidth_mbit = 300
"""


def test_the_ring_order_avoids_the_narrow_link_and_breaks_ties_by_latency() -> None:
    m = parse_matrix(MATRIX)
    links = {lk.pair: (lk.bytes_per_s, lk.latency_ms) for lk in m.links}
    regions = ("us-east-1", "eu-west-1", "ap-southeast-1", "sa-east-1")
    # Rings from us-east-1 (either direction): us-eu-ap-sa has links of 200/400/300/400 Mbit/s; both
    # others cross eu-west-1 - sa-east-1 (20 Mbit/s).
    assert ring_order(regions, links) == ("us-east-1", "eu-west-1", "ap-southeast-1", "sa-east-1")
    # Every ring's slowest link at 200 Mbit/s: the least total latency wins (us-ap-eu-sa: 345 ms
    # against 433 and 488), in its lexically first direction.
    even = dict(links)
    even[frozenset(("eu-west-1", "sa-east-1"))] = (200e6 / 8, 90.0)
    even[frozenset(("us-east-1", "ap-southeast-1"))] = (200e6 / 8, 110.0)
    even[frozenset(("ap-southeast-1", "sa-east-1"))] = (300e6 / 8, 250.0)
    assert ring_order(regions, even) == ("us-east-1", "ap-southeast-1", "eu-west-1", "sa-east-1")
    assert ring_order(regions, None) == regions  # no matrix: the job's order
    assert ring_order(regions[:3], links) == regions[:3]  # three regions make one ring either way


def run_ranks(mode: str, members: str, out: Path, compression: str = "none", timeout: float = 120) -> dict[str, dict[str, float]]:
    """Every rank of every region of ``members`` as its own process; their JSON results by region-rank."""
    store = host_store("127.0.0.1", timeout_s=60)
    procs = []
    for spec in members.split(","):
        region, n = spec.split(":")
        for k in range(int(n)):
            argv = [sys.executable, "-P", str(RANK_JOB), mode, region, str(k), str(store.port), members, compression, str(out)]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
            assert p.returncode == 0, "\n".join(outputs)[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}


@pytest.mark.parametrize(
    "members",
    ["us-east-1:2,eu-west-1:3", "us-east-1:1,eu-west-1:2,ap-southeast-1:3"],
)
def test_the_sharded_exchange_equals_a_plain_all_reduce_to_fp32_rounding(members: str, tmp_path: Path) -> None:
    results = run_ranks("sum", members, tmp_path)
    ranks = {g: int(n) for g, n in (x.split(":") for x in members.split(","))}
    assert sorted(results) == sorted(f"{g}-{k}" for g, n in ranks.items() for k in range(n))
    m = len(ranks)
    u = 2.0**-24
    for name, doc in results.items():
        assert doc["numel"] == 100_003
        # fp32 sums of m values: each element within (m-1) u sum |x| of the exact sum, and so is the reference
        assert doc["max_rel_to_bound"] <= 2 * (m - 1) * u * 1.01, (name, doc)
        assert doc["max_abs"] < 1e-5, (name, doc)
        assert doc["sent"] > 0
        # the store carried the groups' rendezvous only: far less than one shard (100,003 fp32 values = 400 kB)
        assert doc["store_bytes"] < 20_000, (name, doc)


def test_a_compressed_exchange_sums_within_the_dtypes_rounding(tmp_path: Path) -> None:
    results = run_ranks("sum", "us-east-1:1,eu-west-1:2,ap-southeast-1:2", tmp_path, compression="fp16")
    for name, doc in results.items():
        # fp16: each value rounded once (u = 2^-11), two sums rounded, the fp32 reference's own rounding
        assert 0 < doc["max_rel_to_bound"] <= 3 * 2.0**-11 + 4 * 2.0**-24, (name, doc)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 4])
def test_geoshard_train_with_the_p2p_transport_trains_and_keeps_bulk_bytes_out_of_the_store(overlap: int, tmp_path: Path) -> None:
    from test_diloco_train import EU, US, local_plan, train_argv

    plan = local_plan(tmp_path, {US: 2, EU: 1}, samples=3000)
    out = tmp_path / "run"
    steps, h = 60, 10
    extra = ("--outer-transport", "p2p", "--outer-streams", 3, "--outer-overlap", overlap)
    argv = train_argv(plan, out, f"{US}:1,{EU}:2", "--steps", steps, "--outer-steps", h, "--lr", 0.05, "--hidden", 256, *extra)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=500, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip() == "", done.stderr[-3000:]  # no warning: no round missed, refused or failed
    stdout = done.stdout.splitlines()
    for region, n in ((US, 1), (EU, 2)):
        start = (
            f"geoshard.trainer: {region}: {n} of the job's 3 rank(s); {INNER[n > 1]}, DiLoCo across {US}:1,{EU}:2 "
            f"every {h} steps (outer lr 0.7, momentum 0.9, Nesterov, fp16; peer to peer, sharded over every rank, 3 streams)"
        )
        assert start in stdout, stdout[:10]
    report = json.loads((out / "report.json").read_text())
    assert report["sync"] == "diloco" and report["world_size"] == 3 and report["complete"]
    assert report["loss_last"] < report["loss_first"] - 0.05, (report["loss_first"], report["loss_last"])
    outer = report["outer"]
    assert [r["round"] for r in outer["rounds"]] == list(range(1, steps // h + 1))
    for r in outer["rounds"]:
        assert r["regions"] == [US, EU] and r["missing"] == [], r
    assert outer["regions"][US] == outer["regions"][EU] == {"rounds": 6, "rounds_missed": 0, "adopted": 0, "joins": 1, "steps_lost": 0}
    assert report["cross_region_grad_bytes"] == 0 and report["cross_region_data_bytes"] == 0
    for region in (US, EU):
        recs = [json.loads(x) for x in (out / f"rounds-{region}.jsonl").read_text().splitlines()]
        rounds = [x for x in recs if x["event"] == "round"]
        assert [x["round"] for x in rounds] == list(range(1, 7))
        for x in rounds:
            assert x["transport"] == "p2p" and not x["adopted"] and x["missing"] == [] and "left_out" not in x
            # membership, rendezvous and MAC keys only: far below one pseudo-gradient
            assert 0 < x["store_bytes"] < 100_000, x
            # where the round's time went: every phase a member passes through, none negative, and
            # together no more than the exchange itself
            ph = x["phases"]
            assert {"members", "groups", "mac_publish", "transfer", "mac_check", "step", "gather"} <= set(ph), ph
            assert min(ph.values()) >= 0 and sum(ph.values()) <= x["exchange_s"] + 0.01, (ph, x["exchange_s"])
            assert x["applied_step"] == min(x["step"] + overlap, steps)  # the last round is taken at the end


def start_ranks(mode: str, members: str, out: Path, port: int, compression: str = "fp16") -> list[subprocess.Popen[str]]:
    key = out / "secret"
    if not key.exists():
        key.touch(mode=0o600)
        key.write_bytes(b"s" * 32)
    procs = []
    for spec in members.split(","):
        region, n = spec.split(":")
        region_port = _free_port()
        for k in range(int(n)):
            argv = [sys.executable, "-P", str(RANK_JOB), mode, region, str(k), str(port), members, compression, str(out), str(region_port)]
            with (out / f"{region}-{k}.log").open("w") as log:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True))
    return procs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def records(out: Path, name: str) -> list[dict[str, object]]:
    return [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_contribution_changed_after_its_projections_were_published_is_refused_by_the_mac(tmp_path: Path) -> None:
    store = host_store("127.0.0.1", timeout_s=60)
    members = "us-east-1:1,eu-west-1:2"
    procs = start_ranks("mac", members, tmp_path, store.port)
    for p in procs:
        assert p.wait(timeout=300) == 0, "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    logs = {f.stem: f.read_text() for f in tmp_path.glob("*.log")}
    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1"):
        recs = records(tmp_path, name)
        region = name.rsplit("-", 1)[0]
        assert [r["round"] for r in recs] == [1, 2, 3]
        assert all(r["regions"] == ["us-east-1", "eu-west-1"] and r["transport"] == "p2p" for r in recs)
        assert "left_out" not in recs[0] and "left_out" not in recs[2], name
        why = recs[1]["left_out"][region]
        # shard 0 is the one eu-west-1's rank 0 owns and changed; every region took the same decision
        assert why.startswith("shard 0: unauthenticated: its projection") or why == "another rank of the region refused a shard's sum", why
        warned = [line for line in logs[name].splitlines() if "refuses outer round" in line]
        line = f"DiLoCo: region {region} refuses outer round 2 ({why}); it keeps its own parameters for it"
        assert warned == [f"WARNING geoshard.trainer.diloco.p2p: {line}"]
        assert "Traceback" not in logs[name]
        # the refused round's staged step was never committed: the outer momentum is exactly as it
        # was, and so is the model of a one-rank region (this job's ranks of a region train apart,
        # without DDP, so a region of two gathers its ranks' different shards); the rounds around it changed both
        assert recs[1]["momentum"] == recs[1]["momentum_before"], name
        assert recs[1]["digest"] == recs[1]["digest_before"] or region == "eu-west-1", name
        for rec in (recs[0], recs[2]):
            assert rec["digest"] != rec["digest_before"] and rec["momentum"] != rec["momentum_before"], (name, rec)
    assert records(tmp_path, "us-east-1-0")[1]["refused"] == 1


def assert_dropped(tmp_path: Path, failed_at: float) -> None:
    """ap-southeast-1, lost in round 2, is out of round 2's redo within 10 s of ``failed_at`` (when
    its loss showed) on every survivor, and round 3 never waits for it (its roster entry is -1)."""
    from geoshard.trainer.diloco.membership import REDO_WAIT_S

    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1"):
        recs = records(tmp_path, name)
        assert [r["round"] for r in recs] == [1, 2, 3, 4]
        assert recs[0]["regions"] == ["us-east-1", "eu-west-1", "ap-southeast-1"]
        for r in recs[1:]:
            assert r["regions"] == ["us-east-1", "eu-west-1"] and r["missing"] == ["ap-southeast-1"] and "left_out" not in r, r
        assert recs[1]["time"] - failed_at < 10.0, recs[1]["time"] - failed_at
        assert recs[2]["exchange_s"] < REDO_WAIT_S, recs[2]


@pytest.mark.slow
def test_a_region_killed_mid_exchange_is_dropped_within_the_bound_and_the_others_finish(tmp_path: Path) -> None:
    store = host_store("127.0.0.1", timeout_s=60)
    members = "us-east-1:1,eu-west-1:2,ap-southeast-1:1"
    procs = start_ranks("kill", members, tmp_path, store.port)
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0, 0, -9], "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    # round 2 redone without it: its sockets closed, gloo raised at once, the redo waited REDO_WAIT_S for it
    assert_dropped(tmp_path, float((tmp_path / "killed-ap-southeast-1-0").read_text()))
    assert (tmp_path / "ap-southeast-1-0.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
def test_a_region_stopped_mid_exchange_is_dropped_within_10_s_of_its_deadline_and_the_others_finish(tmp_path: Path) -> None:
    """SIGSTOP, not SIGKILL: its sockets stay open, so nothing fails at once; gloo's timeout (the
    round's, 20 s in the job) is the deadline, after which the survivors redo the round without it."""
    store = host_store("127.0.0.1", timeout_s=60)
    members = "us-east-1:1,eu-west-1:2,ap-southeast-1:1"
    procs = start_ranks("stop", members, tmp_path, store.port)
    try:
        codes = [p.wait(timeout=300) for p in procs[:3]]
        assert codes == [0, 0, 0], "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
        assert procs[3].poll() is None  # still there, stopped
    finally:
        procs[3].kill()
        procs[3].wait(timeout=30)
    deadline_s = 20.0  # the job's round_timeout_s: gloo's bound on every collective
    assert_dropped(tmp_path, float((tmp_path / "killed-ap-southeast-1-0").read_text()) + deadline_s)
    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()


@pytest.mark.slow
def test_a_region_that_rejoins_gets_the_outer_state_peer_to_peer_and_the_store_carries_under_1_mb_a_round(tmp_path: Path) -> None:
    store = host_store("127.0.0.1", timeout_s=60)
    members = "us-east-1:1,eu-west-1:2,ap-southeast-1:1"
    procs = start_ranks("rejoin", members, tmp_path, store.port)
    ap = procs[-1]
    assert ap.wait(timeout=300) == -9, "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    (tmp_path / "ap-southeast-1-0.log").rename(tmp_path / "ap-southeast-1-0.first")
    argv = [*ap.args, "again"]  # type: ignore[misc]
    with (tmp_path / "ap-southeast-1-0.log").open("w") as log:
        again = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    codes = [p.wait(timeout=300) for p in (*procs[:-1], again)]
    assert codes == [0, 0, 0, 0], "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    ap_recs = records(tmp_path, "ap-southeast-1-0")
    assert ap_recs[0]["round"] == 1  # before the kill
    # back: it may sit out a round it came too late for (keeping its own parameters), then takes the
    # state in the first round it is a member of
    late = [r for r in ap_recs[1:] if "ap-southeast-1" not in r["regions"]]
    back = ap_recs[1 + len(late) :]
    assert all(not r["adopted"] for r in late) and len(late) <= 1, late
    assert back and back[0]["adopted"] and "ap-southeast-1" in back[0]["regions"], back[:1]
    us = {r["round"]: r for r in records(tmp_path, "us-east-1-0")}
    assert sorted(us) == list(range(1, 11))
    for r in back:  # from the round it took the state on, it holds the same parameters as the others
        assert r["digest"] == us[r["round"]]["digest"], (r, us[r["round"]])
        assert r["regions"] == ["us-east-1", "eu-west-1", "ap-southeast-1"]
    assert not any(r["adopted"] for r in back[1:])
    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1", "ap-southeast-1-0"):
        for r in records(tmp_path, name):
            assert r["store_bytes"] < 1_000_000, (name, r)  # the 2.6 MB state never went through it
    assert max(r["store_bytes"] for r in records(tmp_path, "us-east-1-0")) < 100_000


@pytest.mark.slow
@pytest.mark.parametrize("members", ["us-east-1:1,eu-west-1:2", "us-east-1:2,eu-west-1:1"])
def test_round_0_goes_peer_to_peer_and_every_region_starts_from_the_first_regions_parameters(members: str, tmp_path: Path) -> None:
    """A fresh job: every rank's model is seeded apart; round 0 takes us-east-1's (the job's first
    region's) parameters to every rank of eu-west-1 over the shards' groups, never through the store."""
    store = host_store("127.0.0.1", timeout_s=60)
    procs = start_ranks("first", members, tmp_path, store.port)
    for p in procs:
        assert p.wait(timeout=300) == 0, "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    ranks = {g: int(n) for g, n in (x.split(":") for x in members.split(","))}
    names = [f"{g}-{k}" for g, n in ranks.items() for k in range(n)]
    joins = {name: json.loads((tmp_path / f"{name}.join.json").read_text()) for name in names}
    source = joins["us-east-1-0"]["before"]
    numel = 32 * 8192 + 8192 + 8192 * 8 + 8  # 335,880 parameters: 1.34 MB in fp32, more than the store may carry
    for name, doc in joins.items():
        assert doc["after"] == source, (name, doc)  # every rank of every region starts from the same parameters
        assert doc["round"] == 0 and doc["created"] == name.startswith("us-east-1"), (name, doc)  # the region that created the job
        assert 0 < doc["store_bytes"] < 1_000_000, (name, doc)  # membership and rendezvous only
        if name.startswith("eu-west-1"):
            assert doc["before"] != source, name  # the parameters it holds came from us-east-1
    # each eu-west-1 owner took its shards across regions: together exactly the fp32 parameters once
    assert sum(joins[f"eu-west-1-{k}"]["bytes_read"] for k in range(ranks["eu-west-1"])) == 4 * numel
    assert all(joins[f"us-east-1-{k}"]["bytes_read"] == 0 for k in range(ranks["us-east-1"]))
    by_round: dict[int, set[object]] = {}
    for name in names:
        recs = records(tmp_path, name)
        assert [r["round"] for r in recs] == [1, 2], name
        for r in recs:
            assert r["regions"] == ["us-east-1", "eu-west-1"] and not r["adopted"] and "left_out" not in r, (name, r)
            assert r["store_bytes"] < 1_000_000, (name, r)
            by_round.setdefault(int(r["round"]), set()).add(r["digest"])  # type: ignore[call-overload]
        assert "WARNING" not in (tmp_path / f"{name}.log").read_text(), name
    assert all(len(d) == 1 for d in by_round.values()), by_round  # the regions stay together afterwards


@pytest.mark.slow
def test_round_0_parameters_changed_on_the_wire_are_refused_by_their_signed_digests(tmp_path: Path) -> None:
    """us-east-1 publishes the signed HMAC of each round-0 piece it sends, then changes its shards
    (by 1e-3: a tamperer on the wire): every eu-west-1 rank refuses round 0 in one line and stops
    before using them; us-east-1 goes on alone."""
    store = host_store("127.0.0.1", timeout_s=60)
    procs = start_ranks("forge0", "us-east-1:1,eu-west-1:2", tmp_path, store.port)
    codes = [p.wait(timeout=300) for p in procs]
    logs = "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    assert codes == [0, 3, 3], (codes, logs)
    for k in range(2):
        line = (tmp_path / f"eu-west-1-{k}.refused").read_text()
        head = "DiLoCo: outer round 0 from us-east-1: refused"
        mine = f"piece 0 of diloco/r/0/0/state/{k}: the bytes that arrived do not match the source's signed digest"
        assert line in (f"{head} ({mine})", f"{head} (another rank of the region refused its shard)"), line
        assert not (tmp_path / f"eu-west-1-{k}.join.json").exists()  # it stopped before using them
    assert "Traceback" not in logs, logs
    assert [r["regions"] for r in records(tmp_path, "us-east-1-0")][-1] == ["us-east-1"]


@pytest.mark.slow
def test_a_region_that_comes_after_round_0_closed_takes_the_outer_state_in_its_first_round(tmp_path: Path) -> None:
    """us-east-1 and eu-west-1 (2 ranks) take round 0 among themselves (the join's wait 4 s);
    ap-southeast-1 starts 8 s late, after round 0 closed and before round 1 did (the others take
    their first step 6 s after join): it keeps its own parameters, and in the first round it is a
    member of takes the outer state peer to peer. (One that comes after round 1 closed takes the
    rejoin's path: test_a_region_that_rejoins_...)"""
    store = host_store("127.0.0.1", timeout_s=60)
    procs = start_ranks("late", "us-east-1:1,eu-west-1:2,ap-southeast-1:1", tmp_path, store.port)
    for p in procs:
        assert p.wait(timeout=300) == 0, "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    joins = {name: json.loads((tmp_path / f"{name}.join.json").read_text()) for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1")}
    source = joins["us-east-1-0"]["before"]
    assert all(doc["after"] == source and doc["round"] == 0 for doc in joins.values()), joins
    ap_join = json.loads((tmp_path / "ap-southeast-1-0.join.json").read_text())
    assert ap_join["after"] == ap_join["before"] != source and ap_join["round"] == 0, ap_join  # its own parameters
    assert ap_join["bytes_read"] == 0 and ap_join["store_bytes"] < 1_000_000, ap_join
    ap_log = (tmp_path / "ap-southeast-1-0.log").read_text()
    came = "DiLoCo: region ap-southeast-1 came after outer round 0 closed; it takes the outer state in its first round"
    assert ap_log.count(came) == 1 and "Traceback" not in ap_log, ap_log[-3000:]
    us = {r["round"]: r for r in records(tmp_path, "us-east-1-0")}
    assert sorted(us) == list(range(1, 9)) and not any(r["adopted"] for r in us.values())
    ap = records(tmp_path, "ap-southeast-1-0")
    assert ap[0]["round"] == ap_join["round"] + 1, (ap_join, ap[0])
    late = [r for r in ap if "ap-southeast-1" not in r["regions"]]
    back = ap[len(late) :]
    assert len(late) <= 1 and back and back[0]["adopted"], ap  # at most one round it came too late for
    for r in back:
        if r["round"] in us:  # with the others: the same parameters from the round it took the state on
            assert r["digest"] == us[r["round"]]["digest"] and "ap-southeast-1" in us[r["round"]]["regions"], (r, us[r["round"]])
    assert all(r["store_bytes"] < 1_000_000 for name in ("us-east-1-0", "ap-southeast-1-0") for r in records(tmp_path, name))


def test_a_store_clone_is_a_client_of_its_own_and_counts_into_its_parent() -> None:
    """Groups made at once each rendezvous on a clone: a blocking wait on one client must not hold
    another's keys, and the round's store bytes still add up on the store the exchange counts."""
    server = host_store("127.0.0.1", timeout_s=10)
    store = CountingStore(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
    clone = store.clone()
    waiting = threading.Thread(target=lambda: store.wait(["k"], datetime.timedelta(seconds=10)))
    waiting.start()  # the parent's client blocks in a wait ...
    clone.set("k", b"value")  # ... which only another client's set can end
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    assert store.get("k") == b"value"
    assert clone.carried == 0 and store.carried == len("k") + len(b"value") + len("k") + len("k") + len(b"value")


def test_waves_halve_and_their_count_is_the_same_for_every_shard_of_a_layout() -> None:
    from geoshard.trainer.diloco.sharded import WAVE_MIN, wave_count, waves

    assert waves(100, 4) == [(0, 50), (50, 75), (75, 87), (87, 100)]
    assert waves(3, 4) == [(0, 1), (1, 2), (2, 3)] and waves(1, 4) == [(0, 1)]
    assert wave_count(Layout(45_500_000, 1, 1, 0)) == 1  # the default: one wave (more measured slower)
    assert wave_count(Layout(11_000_000, 1, 1, 0), 4) == 2  # 22 MB fp16, one rank a region: two waves of 5.5M
    assert wave_count(Layout(45_500_000, 1, 1, 0), 4) == 4
    assert wave_count(Layout(2 * WAVE_MIN - 1, 1, 1, 0), 4) == 1  # a second wave would be under WAVE_MIN
    layout = Layout(40_003, 3, 2, 1)
    assert wave_count(layout, 4, 1000) == 4
    assert {len(waves(b - a, 4)) for a, b in map(layout.span, range(3))} == {4}


def test_the_pipelined_exchange_gathers_torch_sgds_step_and_changes_nothing_it_was_given() -> None:
    """Three ranks in threads on 127.0.0.1 (us-east-1:1, eu-west-1:2; S = 2), 8 streams, a
    40,003-value vector in 4 waves: every rank's gathered parameters are torch SGD's Nesterov step
    on the two regions' mean, each owner's wave-fed projections are its sum's, and the outer
    parameters and momentum handed to the pipeline are untouched (a refused round commits nothing)."""
    import torch

    from geoshard.trainer.diloco import mac
    from geoshard.trainer.diloco.auth import Signer
    from geoshard.trainer.diloco.groups import LOOPBACK, GroupCache, gloo_group
    from geoshard.trainer.diloco.pipeline import Gather, Pipeline
    from geoshard.trainer.diloco.settings import OuterSync
    from geoshard.trainer.diloco.sharded import Membership, ShardGroups, make_groups, start_waves, wave_count

    numel, signer = 40_003, Signer(b"pipeline-test-secret-0123456789abcdef")
    sync = OuterSync(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    members = Membership((("us-east-1", 1), ("eu-west-1", 2)), "t")
    g = torch.Generator().manual_seed(3)
    contrib = {r: torch.randn(numel, generator=g) for r in ("us-east-1", "eu-west-1")}
    params, momentum = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    store = host_store("127.0.0.1", timeout_s=60)
    results: dict[tuple[str, int], dict] = {}

    def rank(region: str, n: int, k: int) -> None:
        client = CountingStore(dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60)))
        layout = Layout(numel, 2, n, k)
        rg = gloo_group(client.clone(), f"region/{region}/", k, n, LOOPBACK, 60) if n > 1 else None
        groups = ShardGroups(client, "x", layout, members, region, 8, LOOPBACK, 60, GroupCache())
        make_groups(groups, layout.mine)
        p0 = torch.cat([params[slice(*layout.span(s))] for s in layout.mine])
        m0 = torch.cat([momentum[slice(*layout.span(s))] for s in layout.mine])
        before = (p0.clone(), m0.clone())
        gather = Gather(layout, rg, wave_count(layout, 4, 1000))
        values = {s: contrib[region][slice(*layout.span(s))].clone() for s in layout.mine}
        works, spans, _ = start_waves(groups, values, 4, 1000)
        pipe = Pipeline(layout, signer, "t", values, spans)
        pipe.stage(gather, p0, m0, 2, sync)
        for w, wave in enumerate(works):
            for work in wave:
                work.wait()
            pipe.landed(w)
        whole = gather.finish(pipe.landed_waves)
        untouched = torch.equal(p0, before[0]) and torch.equal(m0, before[1])
        results[(region, k)] = {"whole": whole, "waves": len(spans), "full": gather.full, "untouched": untouched}
        results[(region, k)]["projections"] = (pipe.projections(), values)

    threads = [threading.Thread(target=rank, args=a) for a in (("us-east-1", 1, 0), ("eu-west-1", 2, 0), ("eu-west-1", 2, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == [("eu-west-1", 0), ("eu-west-1", 1), ("us-east-1", 0)]
    ref = params.clone()
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt.state[ref]["momentum_buffer"] = momentum.clone()
    ref.grad = (contrib["us-east-1"] + contrib["eu-west-1"]) / 2
    opt.step()
    for name, res in results.items():
        assert res["whole"] and res["waves"] == 4 and res["untouched"], name
        assert torch.allclose(res["full"], ref, rtol=0, atol=1e-6), (name, float((res["full"] - ref).abs().max()))
        got, values = res["projections"]
        for s, t in values.items():
            want = mac.project(signer, "t", s, t)
            assert all(abs(a - b) <= 1e-9 * want[-1] for a, b in zip(got[s], want, strict=True)), (name, s)


def test_a_wave_landed_block_by_block_steps_and_projects_as_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank a region, two waves of a 25,001-value shard taken 1,000 values at a time (blocks
    that do not divide the waves): the staged parameters and momentum are torch SGD's Nesterov step
    on the mean, the gathered vector holds them, the projections are one ``mac.project`` of the
    sum's, and the parameters and momentum handed in are untouched."""
    import torch

    from geoshard.trainer.diloco import mac, pipeline
    from geoshard.trainer.diloco.auth import Signer
    from geoshard.trainer.diloco.pipeline import Gather, Pipeline
    from geoshard.trainer.diloco.settings import OuterSync
    from geoshard.trainer.diloco.sharded import waves

    monkeypatch.setattr(pipeline, "BLOCK", 1000)
    numel, signer = 25_001, Signer(b"blocks-test-secret-0123456789abcdef")
    sync = OuterSync(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(5)
    summed = torch.randn(numel, generator=g).half()  # the sum as it lands (fp16)
    params, momentum = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    before = (params.clone(), momentum.clone())
    layout = Layout(numel, 1, 1, 0)
    spans = [[(0, a, b)] for a, b in waves(numel, 2)]
    gather = Gather(layout, None, 2)
    pipe = Pipeline(layout, signer, "blocks", {0: summed}, spans)
    pipe.stage(gather, params, momentum, 3, sync)
    pipe.landed(0)
    pipe.landed(1)
    assert gather.finish(pipe.landed_waves)
    ref = before[0].clone()
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt.state[ref]["momentum_buffer"] = before[1].clone()
    ref.grad = summed.float() / 3
    opt.step()
    assert pipe.staged_p is not None and pipe.staged_m is not None
    assert torch.allclose(pipe.staged_p, ref, rtol=0, atol=1e-6)
    assert torch.allclose(pipe.staged_m, opt.state[ref]["momentum_buffer"], rtol=0, atol=1e-6)
    assert torch.equal(gather.full, pipe.staged_p)
    assert torch.equal(params, before[0]) and torch.equal(momentum, before[1])
    want = mac.project(signer, "blocks", 0, summed)
    got = pipe.projections()[0]
    assert all(abs(a - b) <= 1e-9 * want[-1] for a, b in zip(got, want, strict=True))
