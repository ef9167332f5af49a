"""DiLoCo across regions (trainer/diloco/): each region is its own gloo world in its own
processes, and the region leaders meet in a TCPStore that this test process hosts, as the
launcher does (it outlives every region)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from geoshard.errors import ConfigError
from geoshard.trainer.diloco import DiLoCo, OuterSync, OuterSyncError, RoundRecord, connect_store, decode, encode, host_store

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "diloco_region.py"
REGIONS = ("us-east-1", "eu-west-1")
SECRET = secrets.token_bytes(32)  # the job's; the region processes read it from OUT/outer-secret


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    mode: str, region: str, rank: int, size: int, region_port: int, store_port: int, out: Path, p2p: str = ""
) -> subprocess.Popen[str]:
    """One rank of ``region``; ``p2p``: each region's rank count (REGIONS' order) for the peer-to-peer transport."""
    argv = [sys.executable, "-P", str(JOB), mode, region, str(rank), str(size), str(region_port), str(store_port), str(out)]
    env = {**os.environ, "DILOCO_TRANSPORT": "p2p" if p2p else "store", "DILOCO_RANKS": p2p or "1,1"}
    key = out / "outer-secret"
    if not key.exists():
        key.touch(mode=0o600)
        key.write_bytes(SECRET)
    with (out / f"{mode}-{region}-{rank}-{time.monotonic_ns()}.log").open("w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, cwd=out, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def finish(procs: list[subprocess.Popen[str]], out: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            logs = "\n".join(f.read_text()[-2000:] for f in out.glob("*.log"))
            assert rc == 0, f"a region process exited {rc}:\n{logs}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_outer_sync_settings_are_checked_with_one_line_naming_the_field() -> None:
    assert OuterSync().outer_lr == 0.7 and OuterSync().outer_momentum == 0.9 and OuterSync().nesterov
    for bad, field in (
        ({"outer_steps": 0}, "outer_steps"),
        ({"compression": "int3"}, "compression"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
    ):
        with pytest.raises(ConfigError, match=field) as e:
            OuterSync(**bad)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not one of the job's regions"):
        DiLoCo(nn.Linear(2, 2), OuterSync(), "mars-1", REGIONS, secret=SECRET)
    with pytest.raises(ConfigError, match="distinct names"):
        DiLoCo(nn.Linear(2, 2), OuterSync(), "a,b", ("a,b", "c"), secret=SECRET)


def test_a_region_with_other_outer_settings_or_another_model_is_refused_at_join() -> None:
    server = host_store()
    first = DiLoCo(nn.Linear(3, 2), OuterSync(outer_steps=5), REGIONS[0], REGIONS, secret=SECRET)
    assert first.join(connect_store("127.0.0.1", server.port)).created
    for model, sync, what in (
        (
            nn.Linear(3, 2),
            OuterSync(outer_steps=7, compression="bf16"),
            "outer_steps 7 (the job has 5); compression bf16 (the job has fp16)",
        ),
        (nn.Linear(4, 2), OuterSync(outer_steps=5), "parameters 10 (the job has 8)"),
    ):
        with pytest.raises(ConfigError) as e:
            DiLoCo(model, sync, REGIONS[1], REGIONS, secret=SECRET).join(connect_store("127.0.0.1", server.port))
        assert str(e.value) == f"DiLoCo: region eu-west-1 does not match the job's outer settings: {what}"


def test_an_unreachable_store_is_one_line_naming_it_within_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(OuterSyncError, match=rf"cannot reach the outer store at 127.0.0.1:{(port := _port())} within 2 s") as e:
        connect_store("127.0.0.1", port, timeout_s=2)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 30


@pytest.mark.parametrize("compression", ["fp16", "bf16", "none"])
def test_compression_halves_the_bytes_and_round_trips_within_its_precision(compression: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-2
    payload = encode(x, compression)
    assert len(payload) == 1000 * (4 if compression == "none" else 2)
    rel, tiny = {"fp16": (1e-3, 1e-7), "bf16": (1e-2, 0.0), "none": (0.0, 0.0)}[compression]  # fp16: subnormals below 6e-5
    back = decode(payload, compression)
    assert back.dtype == torch.float32 and torch.allclose(back, x, rtol=rel, atol=tiny)
    assert compression == "none" or not torch.equal(back, x)  # the cast did happen


def rounds_at(dl: dict[str, DiLoCo], step: int, timeout: float = 60) -> dict[str, RoundRecord | None]:
    """``maybe_sync(step)`` on every leader at once (a thread each), as the regions do."""
    out: dict[str, RoundRecord | None] = {}
    threads = [threading.Thread(target=lambda g=g: out.__setitem__(g, dl[g].maybe_sync(step))) for g in dl]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


def _filled(value: float) -> nn.Module:
    m = nn.Linear(3, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


@pytest.mark.parametrize("compression", ["fp16", "none"])
def test_an_outer_round_with_a_region_missing_averages_over_the_regions_present(compression: str) -> None:
    """Three regions in the job, two leaders (threads, each with its own connection to a real
    TCPStore): the third never publishes. Round 1 waits out its timeout, then averages the two
    pseudo-gradients (0.5 and 0.75 → 0.625) and applies them with lr 1: 1 - 0.625 = 0.375 exactly,
    and records the missing region. Round 2 no longer waits for it."""
    server = host_store()
    regions = ("us-east-1", "eu-west-1", "ap-southeast-1")
    sync = OuterSync(outer_steps=2, outer_lr=1.0, outer_momentum=0.0, compression=compression, round_timeout_s=1.5)
    models = {"us-east-1": _filled(1.0), "eu-west-1": _filled(7.0)}
    dl = {g: DiLoCo(m, sync, g, regions, secret=SECRET) for g, m in models.items()}
    joins = {g: d.join(connect_store("127.0.0.1", server.port)) for g, d in dl.items()}
    assert joins["us-east-1"].created and not joins["eu-west-1"].created
    assert all(p.eq(1.0).all() for p in models["eu-west-1"].parameters())  # took round 0's parameters

    def both(step: int, values: dict[str, float]) -> dict[str, RoundRecord | None]:
        for g, v in values.items():
            with torch.no_grad():
                for p in models[g].parameters():
                    p.fill_(v)
        return rounds_at(dl, step, 30)

    assert both(1, {"us-east-1": 0.5, "eu-west-1": 0.25}) == {"us-east-1": None, "eu-west-1": None}  # not a round step
    recs = both(2, {"us-east-1": 0.5, "eu-west-1": 0.25})
    for g, rec in recs.items():
        assert rec is not None
        assert (rec.round, rec.regions, rec.missing) == (1, ("us-east-1", "eu-west-1"), ("ap-southeast-1",))
        assert rec.sync_s >= 1.4  # it waited for the missing region, bounded by the timeout
        assert all(p.eq(0.375).all() for p in models[g].parameters()), [p.tolist() for p in models[g].parameters()]
        params = 3 * 2 + 2
        assert rec.bytes_read == params * (4 if compression == "none" else 2)  # the other present region's pseudo-gradient
    assert {r.bytes_published > params * 4 for r in recs.values() if r} == {True, False}  # one of the two closed and published the state
    recs = both(4, {"us-east-1": 0.375 - 0.25, "eu-west-1": 0.375})
    for g, rec in recs.items():
        assert rec is not None and rec.round == 2 and rec.missing == ("ap-southeast-1",)
        assert rec.sync_s < 1.0  # a region missing from the last round is no longer waited for
        assert all(p.eq(0.375 - 0.125).all() for p in models[g].parameters())


def test_pseudo_gradients_and_states_larger_than_the_stores_message_limit_go_through_in_parts() -> None:
    """A TCPStore server refuses a message over 8 MiB: a 9 MB fp32 model (pseudo-gradients sent
    uncompressed, the state with its momentum 18 MB) goes through in 4 MiB parts, exactly."""
    server = host_store()
    regions = ("us-east-1", "eu-west-1")
    sync = OuterSync(outer_steps=1, outer_lr=1.0, outer_momentum=0.5, compression="none", round_timeout_s=30)
    models = {g: nn.Linear(1500, 1500, bias=False) for g in regions}
    dl = {g: DiLoCo(m, sync, g, regions, secret=SECRET) for g, m in models.items()}
    for d in dl.values():
        d.join(connect_store("127.0.0.1", server.port))
    start = models["us-east-1"].weight.detach().clone()
    assert torch.equal(models["eu-west-1"].weight, start)  # round 0's 9 MB state, in parts
    with torch.no_grad():
        models["us-east-1"].weight.sub_(1.0)
        models["eu-west-1"].weight.sub_(3.0)
    out: dict[str, RoundRecord | None] = {}
    threads = [threading.Thread(target=lambda g=g: out.__setitem__(g, dl[g].maybe_sync(1))) for g in regions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for g in regions:
        rec = out[g]
        assert rec is not None and rec.regions == regions and rec.bytes_read == 1500 * 1500 * 4
        # The mean pseudo-gradient, 2.0; lr 1 and Nesterov momentum 0.5 make the first step 2.0 * 1.5.
        assert torch.allclose(models[g].weight, start - 3.0, atol=1e-5), g
    late = DiLoCo(nn.Linear(1500, 1500, bias=False), sync, "eu-west-1", regions, secret=SECRET)
    rejoin = late.join(connect_store("127.0.0.1", server.port))  # the published state of round 1: 18 MB
    assert rejoin.round == 1 and rejoin.bytes_read > 2 * 1500 * 1500 * 4
    assert torch.equal(late.model.weight, models["us-east-1"].weight)  # type: ignore[arg-type]


TRANSPORTS = pytest.mark.parametrize("transport", ["store", "p2p"])


@TRANSPORTS
def test_h1_with_outer_lr_1_equals_synchronous_data_parallel_and_outer_lr_07_does_not(transport: str, tmp_path: Path) -> None:
    """Two regions: us-east-1 with 2 ranks (in-region DDP, its own gloo world; each rank half the
    region's batch), eu-west-1 with 1. The reference is one process stepping SGD on the whole
    global batch, i.e. synchronous data parallel with equal batches per region."""
    server = host_store()
    port = _port()
    p2p = "2,1" if transport == "p2p" else ""
    procs = [start("equiv", REGIONS[0], r, 2, port, server.port, tmp_path, p2p) for r in (0, 1)]
    procs.append(start("equiv", REGIONS[1], 0, 1, _port(), server.port, tmp_path, p2p))
    finish(procs, tmp_path)
    lead = json.loads((tmp_path / "equiv-us-east-1-0.json").read_text())
    other = json.loads((tmp_path / "equiv-us-east-1-1.json").read_text())
    far = json.loads((tmp_path / "equiv-eu-west-1-0.json").read_text())
    assert lead["lr1"]["max_abs_diff_to_sync_dp"] < 1e-5, lead["lr1"]
    assert lead["lr07"]["max_abs_diff_to_sync_dp"] > 1e-3, lead["lr07"]  # the check can fail
    for run in ("lr1", "lr07"):
        # Every rank of every region holds the same parameters after each round.
        assert lead[run]["digest"] == other[run]["digest"] == far[run]["digest"]
        recs = lead[run]["records"]
        assert [r["round"] for r in recs] == list(range(1, 9))
        assert all(r["regions"] == list(REGIONS) and r["missing"] == [] and r["compression"] == "none" for r in recs)
        assert [r["round"] for r in other[run]["records"]] == list(range(1, 9))  # the non-leader got the records by broadcast


@TRANSPORTS
def test_with_h5_the_loss_goes_down_and_the_regions_agree(transport: str, tmp_path: Path) -> None:
    server = host_store()
    procs = [start("loss", g, 0, 1, _port(), server.port, tmp_path, "1,1" if transport == "p2p" else "") for g in REGIONS]
    finish(procs, tmp_path)
    a, b = (json.loads((tmp_path / f"loss-{g}.json").read_text()) for g in REGIONS)
    losses = a["eval_loss"]
    assert len(losses) == 11  # before, and after each of the 10 rounds
    assert losses[-1] < 0.3 * losses[0], losses
    assert all(later <= earlier + 0.01 for earlier, later in itertools.pairwise(losses)), losses  # no round undoes progress
    assert a["digest"] == b["digest"]
    moved = "bytes_published" if transport == "p2p" else "bytes_read"  # p2p: what this rank sent peer to peer
    assert all(r[moved] > 0 and r["compression"] == "fp16" and r["missing"] == [] for r in a["records"])
    assert all(r.get("transport", "store") == transport for r in a["records"])


@TRANSPORTS
def test_with_overlap_the_exchange_runs_behind_training_and_the_regions_still_agree(transport: str, tmp_path: Path) -> None:
    """H=10, the exchange 8 steps behind, a store 20 ms away per call; us-east-1 with 2 ranks."""
    server = host_store()
    port = _port()
    p2p = "2,1" if transport == "p2p" else ""
    procs = [start("overlap", REGIONS[0], r, 2, port, server.port, tmp_path, p2p) for r in (0, 1)]
    procs.append(start("overlap", REGIONS[1], 0, 1, _port(), server.port, tmp_path, p2p))
    finish(procs, tmp_path)
    lead, other, far = (
        json.loads((tmp_path / f"overlap-{g}-{r}.json").read_text()) for g, r in ((REGIONS[0], 0), (REGIONS[0], 1), (REGIONS[1], 0))
    )
    recs = lead["records"]
    assert [r["round"] for r in recs] == list(range(1, 11))
    assert [r["applied_step"] for r in recs] == [10 * n + 8 for n in range(1, 10)] + [100]  # the last one at the end
    assert all(r["regions"] == list(REGIONS) and r["missing"] == [] for r in recs)
    # The rounds took their time (each leader makes ten or more 20 ms calls), but training waited far less.
    exchange = sum(r["exchange_s"] for r in recs[1:-1])  # the first round also waits for the slowest start
    waited = sum(r["sync_s"] for r in recs[1:-1])
    assert exchange > 8 * 0.2 and waited < 0.5 * exchange, (exchange, waited)
    losses = lead["eval_loss"]
    assert losses[-1] < 0.3 * losses[0], losses
    # After the last round (nothing learnt since it started) every rank holds the outer parameters.
    assert lead["digest"] == other["digest"] == far["digest"]


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _until(what: str, cond: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_killed_region_is_averaged_out_and_rejoins_from_the_published_outer_state(tmp_path: Path) -> None:
    """SIGKILL both ranks of eu-west-1 (in-region DDP) mid-run: us-east-1 goes on in the same
    process, losing at most the round in flight (one wait of round_timeout_s), then no longer
    waits. eu-west-1 restarted starts from the newest published outer parameters (the same bytes
    us-east-1 holds after that round, on both of its ranks) and takes part in the rounds again."""
    server = host_store()
    a_log, b_log, b1_log = (tmp_path / f"{name}.jsonl" for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1"))
    a = start("chaos", REGIONS[0], 0, 1, _port(), server.port, tmp_path)
    port = _port()
    b = [start("chaos", REGIONS[1], r, 2, port, server.port, tmp_path) for r in (0, 1)]
    procs = [a, *b]
    try:
        _until("eu-west-1's second round", lambda: len([r for r in _lines(b_log) if "round" in r]) >= 2)
        for p in b:
            os.kill(p.pid, signal.SIGKILL)  # a spot reclaim: every rank of the region at once
        for p in b:
            p.wait(10)
        _until("us-east-1 rounds without eu-west-1", lambda: sum(r.get("missing") == ["eu-west-1"] for r in _lines(a_log)) >= 3)
        port = _port()
        b2 = [start("chaos", REGIONS[1], r, 2, port, server.port, tmp_path) for r in (0, 1)]
        procs += b2

        def rejoined() -> bool:
            lines = [r for r in _lines(b_log) if r["pid"] == b2[0].pid and "round" in r and not r["adopted"]]
            return len(lines) >= 2

        _until("eu-west-1 back in two rounds", rejoined)
        server.set("chaos/stop", "1")
        finish([a, *b2], tmp_path, timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    a_lines = _lines(a_log)
    assert {r["pid"] for r in a_lines} == {a.pid}  # us-east-1 never restarted
    a_rounds = [r for r in a_lines if "round" in r]
    assert [r["round"] for r in a_rounds] == list(range(1, len(a_rounds) + 1))  # and lost no round
    by_round = {r["round"]: r for r in a_rounds}
    killed_after = max(r["round"] for r in _lines(b_log) if r["pid"] == b[0].pid and "round" in r)
    b_lines = [r for r in _lines(b_log) if r["pid"] == b2[0].pid]
    join = b_lines[0]
    assert "join" in join and join["join"] > killed_after + 1
    # The round in flight at the kill (the next, or the one after if eu-west-1 had published it).
    first = min(n for n in range(killed_after + 1, join["join"] + 1) if by_round[n]["missing"] == ["eu-west-1"])
    assert first <= killed_after + 2
    alone = [by_round[n] for n in range(first, join["join"] + 1)]  # from the kill to the state eu-west-1 rejoined from
    assert all(r["regions"] == ["us-east-1"] and r["missing"] == ["eu-west-1"] for r in alone), alone
    assert alone[0]["sync_s"] >= 2.5  # the round in flight waited for the lost region (round_timeout_s 3)...
    assert all(r["sync_s"] < 2.5 for r in alone[1:])  # ...the next ones did not
    assert join["digest"] == by_round[join["join"]]["digest"]  # live recovery: the published outer parameters
    second_lines = [r for r in _lines(b1_log) if r["pid"] == b2[1].pid]
    assert "join" in second_lines[0] and second_lines[0]["digest"] == join["digest"]  # broadcast in the region
    second = {r["round"]: r for r in second_lines[1:]}
    back = [r for r in b_lines[1:] if not r["adopted"]][:2]  # the two seen before the stop (a later one may run alone)
    for r in back:
        assert r["regions"] == list(REGIONS) and by_round[r["round"]]["regions"] == list(REGIONS)
        assert r["digest"] == by_round[r["round"]]["digest"] == second[r["round"]]["digest"]  # one set of outer parameters


def test_rounds_file_lines_keep_their_keys_and_files_without_a_version_read_as_version_1(tmp_path: Path) -> None:
    """One writer (``append``) and one reader (``read_rounds``) for RUN_DIR/rounds-<region>.jsonl;
    a line written before the version field is version 1 and reads the same."""
    from geoshard.errors import DataError
    from geoshard.trainer.diloco.record import VERSION, append, read_rounds, rounds_path
    from geoshard.trainer.diloco.report import outer_section

    join = RoundRecord(0, 0, bytes_read=10, event="join", region="us-east-1", job="h:1", created=True)
    rnd = RoundRecord(1, 5, ("us-east-1", "eu-west-1"), (), 0.25, 100, 200, "fp16", region="us-east-1", job="h:1", steps_lost=2)
    append(rounds_path(tmp_path, "us-east-1"), join)
    append(rounds_path(tmp_path, "us-east-1"), rnd)
    lines = [json.loads(x) for x in rounds_path(tmp_path, "us-east-1").read_text().splitlines()]
    assert list(lines[0]) == ["version", "region", "job", "event", "round", "step", "created", "bytes_read", "steps_lost"]
    round_keys = "region job event round step regions missing sync_s bytes_published bytes_read compression adopted exchange_s"
    assert list(lines[1]) == ["version", *round_keys.split(), "applied_step", "steps_lost"]
    old = {k: v for k, v in lines[1].items() if k != "version"} | {"region": "eu-west-1", "bytes_published": 50}
    rounds_path(tmp_path, "eu-west-1").write_text(json.dumps(old) + "\n" + '{"region": "eu-west-1", "ev')  # and a cut last line
    recs = read_rounds(tmp_path)
    us = [("us-east-1", e, VERSION) for e in ("join", "round")]
    assert [(r.region, r.event, r.version) for r in recs] == [("eu-west-1", "round", 1), *us]
    assert recs[1:] == [join, rnd]
    section = outer_section(tmp_path)
    assert section is not None and section["rounds"] == [
        {"round": 1, "regions": ["us-east-1", "eu-west-1"], "missing": [], "sync_s": 0.25, "bytes": 550, "adopted_by": []}
    ]
    assert section["regions"]["us-east-1"] == {"rounds": 1, "rounds_missed": 0, "adopted": 0, "joins": 1, "steps_lost": 2}
    rounds_path(tmp_path, "eu-west-1").write_text(json.dumps(old | {"step": -1}) + "\n\n")
    with pytest.raises(DataError, match=r"rounds-eu-west-1.jsonl:1: step must be an integer >= 0, got -1"):
        read_rounds(tmp_path)
