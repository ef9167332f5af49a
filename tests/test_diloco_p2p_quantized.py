"""int8 and fp8 pseudo-gradients over the peer-to-peer transport (trainer/diloco/quantized.py): a
reduce-scatter then an all-gather in the codec's bytes among the shards' owners, every piece
checked against its sender's signed HMAC digest before it is decoded. Real processes on 127.0.0.1
around a TCPStore this test hosts; the end-to-end runs are ``geoshard train`` in a subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_diloco_codec import _bound
from test_diloco_train import EU, US, lines, local_plan, train_argv

from geoshard.trainer.checkpoint import CheckpointStore
from geoshard.trainer.diloco import OuterSync, host_store
from geoshard.trainer.diloco.codec import BLOCK, Codec, codec
from geoshard.trainer.diloco.quantized import parts
from geoshard.trainer.diloco.sharded import chunks, per_shard
from geoshard.trainer.diloco.shards import shard_count, span
from geoshard.trainer.model import Net

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "p2p_quantized_rank.py"
NUMEL, STREAMS = 100_003, 3  # as the job's


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(mode: str, members: str, out: Path, compression: str, port: int) -> dict[str, subprocess.Popen[str]]:
    """Every rank of every region as its own process (output in OUT/REGION-RANK.log), by region-rank."""
    key = out / "secret"
    key.touch(mode=0o600)
    key.write_bytes(b"q" * 32)
    procs = {}
    for spec in members.split(","):
        region, n = spec.split(":")
        region_port = _free_port()
        for k in range(int(n)):
            argv = [sys.executable, "-P", str(JOB), mode, region, str(k), str(port), members, compression, str(out), str(region_port)]
            with (out / f"{region}-{k}.log").open("w") as log:
                procs[f"{region}-{k}"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    return procs


def run_ranks(mode: str, members: str, out: Path, compression: str) -> dict[str, str]:
    """Every rank of every region as its own process; their logs by region-rank."""
    store = host_store("127.0.0.1", timeout_s=60)
    procs = start_ranks(mode, members, out, compression, store.port)
    try:
        codes = {name: p.wait(timeout=240) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {name: (out / f"{name}.log").read_text() for name in procs}
    assert set(codes.values()) == {0}, (codes, "\n".join(v[-3000:] for v in logs.values()))
    return logs


def by_hand(name: str, xs: list[torch.Tensor], shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exchange computed here, from the codec alone: per shard, stream chunk and member's part,
    each contribution encoded and decoded, summed in fp32 in member order from zero, the sum
    encoded and decoded once. The result, and per value the stated bound of its distance from
    the fp32 sum (each contribution's rounding, the sum's, and fp32's own)."""
    c, m = codec(name), len(xs)
    out, bound = torch.empty(NUMEL), torch.empty(NUMEL)
    for s in range(shards):
        a, b = span(NUMEL, shards, s)
        for ca, cb in chunks(a, b, per_shard(STREAMS, shards)):
            for x0, y0 in parts(cb - ca, m):
                lo, hi = ca + x0, ca + y0
                total = torch.zeros(hi - lo)
                for x in xs:
                    total += c.decode(c.encode(x[lo:hi]), hi - lo)
                out[lo:hi] = c.decode(c.encode(total), hi - lo)
                bound[lo:hi] = sum(_bound(name, x[lo:hi]) for x in xs) + _bound(name, total)
    bound += (m + 1) * 2.0**-24 * torch.stack(xs).abs().sum(0)
    return out, bound


@pytest.mark.parametrize(
    ("members", "name"),
    [
        ("us-east-1:1,eu-west-1:2", "int8"),
        ("us-east-1:2,eu-west-1:1,ap-southeast-1:2", "int8"),
        ("us-east-1:1,eu-west-1:1,ap-southeast-1:2", "fp8"),
    ],
)
def test_the_quantized_exchange_equals_the_computation_by_hand_exactly_and_the_fp32_sum_within_the_bound(
    members: str, name: str, tmp_path: Path
) -> None:
    run_ranks("sum", members, tmp_path, name)
    ranks = {g: int(n) for g, n in (x.split(":") for x in members.split(","))}
    xs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) * (1 + i) for i in range(len(ranks))]
    want, bound = by_hand(name, xs, shard_count(list(ranks.values())))
    exact = torch.stack(xs).sum(0)
    m, c = len(ranks), codec(name)
    for g, n in ranks.items():
        for k in range(n):
            got = torch.load(tmp_path / f"{g}-{k}.pt")
            assert torch.equal(got, want), (g, k, float((got - want).abs().max()))  # bit for bit, on every rank
            doc = json.loads((tmp_path / f"{g}-{k}.json").read_text())
            assert doc["store_bytes"] < 50_000, doc  # rendezvous and signed digests only (the shard is 400 kB in fp32)
    err = (want - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float((err / bound).max()) > 0.01  # the bound is not vacuous: the rounding is there
    # A one-rank region's owner sent, per chunk, its m-1 other parts and m-1 copies of its own part's sum
    one = next(g for g, n in ranks.items() if n == 1)
    me, shards = list(ranks).index(one), shard_count(list(ranks.values()))
    expected = 0
    for s in range(shards):
        for ca, cb in chunks(*span(NUMEL, shards, s), per_shard(STREAMS, shards)):
            sizes = [c.nbytes(y - x) for x, y in parts(cb - ca, m)]
            expected += sum(sizes) - sizes[me] + (m - 1) * sizes[me]
    sent = json.loads((tmp_path / f"{one}-0.json").read_text())["sent"]
    assert sent == expected
    fp16 = 2 * (m - 1) / m * 2 * NUMEL  # fp16's ring all-reduce of the same values
    assert 0.45 < sent / fp16 <= 0.51, sent / fp16


@pytest.mark.slow
def test_a_byte_changed_on_the_wire_after_its_digest_was_published_is_refused_in_one_line(tmp_path: Path) -> None:
    logs = run_ranks("forge", "us-east-1:1,eu-west-1:2", tmp_path, "int8")
    whys = {}
    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1"):
        recs = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        region = name.rsplit("-", 1)[0]
        assert [r["round"] for r in recs] == [1, 2, 3]
        assert all(r["regions"] == ["us-east-1", "eu-west-1"] and r["transport"] == "p2p" and r["compression"] == "int8" for r in recs)
        assert "left_out" not in recs[0] and "left_out" not in recs[2], name
        whys[name] = why = recs[1]["left_out"][region]
        warned = [line for line in logs[name].splitlines() if "refuses outer round" in line]
        line = f"DiLoCo: region {region} refuses outer round 2 ({why}); it keeps its own parameters for it"
        assert warned == [f"WARNING geoshard.trainer.diloco.p2p: {line}"], logs[name][-2000:]
        assert "Traceback" not in logs[name] and logs[name].count("WARNING") == 1, logs[name][-2000:]
    # us-east-1 received the changed bytes and refused them before decoding; it sent an unusable sum
    # back, so eu-west-1's owner of shard 0 refused too, and its other rank followed its region
    assert whys["us-east-1-0"].startswith("shard 0: unauthenticated: the bytes eu-west-1 sent do not match its signed digest ("), whys
    assert whys["eu-west-1-0"].startswith("shard 0: non-finite: "), whys
    assert whys["eu-west-1-1"] == "another rank of the region refused a shard's sum", whys
    us = [json.loads(x) for x in (tmp_path / "us-east-1-0.jsonl").read_text().splitlines()]
    assert us[1]["refused"] >= 1 and us[0].get("refused", 0) == us[2].get("refused", 0) == 0  # counted in the rounds file


@pytest.mark.slow
def test_a_checkpoints_error_feedback_state_gives_every_rank_its_shards_residual_back(tmp_path: Path) -> None:
    run_ranks("resume", "us-east-1:1,eu-west-1:2", tmp_path, "int8")
    numel = sum(p.numel() for p in torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Linear(512, 8)).parameters())
    docs = {name: json.loads((tmp_path / f"{name}.resume.json").read_text()) for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1")}
    for name, doc in docs.items():
        assert doc["same"] and doc["codec"] == "int8" and doc["numel"] == numel and doc["nonzero"] > 0, (name, doc)
    assert docs["us-east-1-0"]["shards"] == [0, 1] and docs["eu-west-1-0"]["shards"] == [0] and docs["eu-west-1-1"]["shards"] == [1]
    # eu-west-1's two ranks each held half of it: the state summed over the region is the same whole on both
    a, b = (torch.load(tmp_path / f"eu-west-1-{k}.residual.pt") for k in (0, 1))
    assert torch.equal(a, b)
    half = span(numel, 2, 0)[1]
    assert float(a[:half].abs().max()) > 0 and float(a[half:].abs().max()) > 0
    for name in docs:
        recs = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["round"] for r in recs] == [1, 2, 3, 4] and not any("left_out" in r for r in recs), (name, recs)


def test_the_p2p_transport_accepts_int8_and_fp8() -> None:
    for name in ("int8", "fp8"):
        assert OuterSync(compression=name, transport="p2p").compression == name


def _train(tmp_path: Path, compression: str, regions: str, *extra: object) -> tuple[Path, subprocess.CompletedProcess[str]]:
    plan = tmp_path / "plan.toml"
    if not plan.exists():
        plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=2000)
    out = tmp_path / f"run-{compression}"
    argv = train_argv(plan, out, regions, "--steps", 40, "--outer-steps", 10, "--hidden", 256, "--outer-compression", compression)
    argv += ["--checkpoint-every", "20", "--outer-transport", "p2p", "--outer-streams", "2", *map(str, extra)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip() == "", done.stderr[-3000:]  # no warning: no round missed, refused or failed
    return out, done


@pytest.mark.slow
def test_geoshard_train_with_int8_and_fp8_over_p2p_sends_about_half_of_fp16s_bytes_and_keeps_the_store_small(tmp_path: Path) -> None:
    regions = f"{US}:1,{EU}:2"  # eu-west-1's residual is sharded over its two ranks
    per_round: dict[str, list[int]] = {}
    for name in ("fp16", "int8", "fp8"):
        out, done = _train(tmp_path, name, regions)
        for region, n in ((US, 1), (EU, 2)):
            inner = "DDP in the region" if n > 1 else "one rank in the region, no DDP"
            start = (
                f"geoshard.trainer: {region}: {n} of the job's 3 rank(s); {inner}, DiLoCo across {regions} every 10 steps "
                f"(outer lr 0.7, momentum 0.9, Nesterov, {name}; peer to peer, sharded over every rank, 2 streams)"
            )
            assert start in done.stdout.splitlines(), done.stdout[:3000]
            rounds = [r for r in lines(out / f"rounds-{region}.jsonl") if r["event"] == "round"]
            assert [r["round"] for r in rounds] == [1, 2, 3, 4]
            for r in rounds:
                assert r["compression"] == name and r["transport"] == "p2p" and r["regions"] == [US, EU], r
                assert not r["adopted"] and r["missing"] == [] and "left_out" not in r, r
                assert 0 < r["store_bytes"] < 1_000_000, r
            if region == US:  # one rank: what it sent crossed regions (eu-west-1's also holds its in-region gather)
                per_round[name] = [r["bytes_published"] for r in rounds]
        report = json.loads((out / "report.json").read_text())
        assert report["complete"] and report["outer"]["compression"] == name
        assert report["loss_last"] < report["loss_first"] - 0.05, (name, report["loss_first"], report["loss_last"])
        if name != "fp16":  # the region's checkpoint holds the whole residual, both ranks' shards of it
            latest = CheckpointStore(str(out / "checkpoints" / EU), keep=2).load_latest()
            assert latest is not None and latest[0] == 40
            fb = latest[1]["outer"]["feedback"]
            numel = sum(p.numel() for p in Net(256).parameters())
            assert fb["codec"] == name and fb["residual"].shape == (numel,)
            half = span(numel, 2, 0)[1]
            assert float(fb["residual"][:half].abs().max()) > 0 and float(fb["residual"][half:].abs().max()) > 0
    numel = sum(p.numel() for p in Net(256).parameters())
    for name in ("int8", "fp8"):
        for q, f in zip(per_round[name], per_round["fp16"], strict=True):
            assert q / f <= 0.55, (name, per_round)
        # a byte a value plus a 4-byte scale per block, against fp16's 2 bytes
        assert per_round[name][0] / per_round["fp16"][0] < (1 + 4 / BLOCK) / 2 + 0.01 + 8 * math.ceil(numel / BLOCK) / numel


# -- int8 rounds recorded exchange by exchange (tests/jobs/p2p_quantized_rank.py's ``record``) ----------


def exchanges(out: Path, name: str) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = torch.load(out / f"{name}.ex.pt")
    return recs


def rounds_of(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _sent(c: Codec, x: torch.Tensor, cuts: list[list[tuple[int, int]]]) -> torch.Tensor:
    """What an owner's encodings of ``x`` carry, decoded: each part on its own."""
    out = torch.empty_like(x)
    for chunk in cuts:
        for a, b in chunk:
            if b > a:
                out[a:b] = c.decode(c.encode(x[a:b]), b - a)
    return out


def shard_by_hand(c: Codec, xs: list[torch.Tensor], cuts: list[list[tuple[int, int]]]) -> torch.Tensor:
    """One shard's exchange from the codec alone: per part, each member's values encoded and
    decoded, summed in fp32 in member order from zero, the sum encoded and decoded once (a member
    alone: its own values rounded once)."""
    if len(xs) == 1:
        return _sent(c, xs[0], cuts)
    out = torch.empty_like(xs[0])
    for chunk in cuts:
        for a, b in chunk:
            if b > a:
                total = torch.zeros(b - a)
                for x in xs:
                    total += c.decode(c.encode(x[a:b]), b - a)
                out[a:b] = c.decode(c.encode(total), b - a)
    return out


def check_sums(c: Codec, logs: dict[str, list[dict[str, Any]]]) -> set[tuple[int, int, int]]:
    """Every exchange that returned: its members' owners of each shard agree on the members and the
    cuts, and each holds, bit for bit, the sum computed here from their recorded inputs. Returns
    the (round, attempt, shard) sums checked."""
    done: dict[tuple[int, int, str, int], tuple[list[str], dict[str, Any]]] = {}
    for name, recs in logs.items():
        region = name.rsplit("-", 1)[0]
        for e in recs:
            for s, sh in e["shards"].items():
                if e["ok"]:
                    assert (e["r"], e["attempt"], region, s) not in done, (name, e["r"], s)
                    done[(e["r"], e["attempt"], region, s)] = (e["members"], sh)
    checked = set()
    for (r, attempt, region, s), (members, sh) in done.items():
        if region != members[0]:
            continue  # each exchange's shard once
        got = {g: done[(r, attempt, g, s)] for g in members}  # every member's owner of the shard finished it
        assert all(m == members and x["cuts"] == sh["cuts"] for m, x in got.values()), (r, attempt, s)
        assert all(len(chunk) == len(members) for chunk in sh["cuts"])  # a part per member, empty or not
        want = shard_by_hand(c, [got[g][1]["x"] for g in members], sh["cuts"])
        for g, (_, x) in got.items():
            assert torch.equal(x["sum"], want), (r, attempt, g, s, float((x["sum"] - want).abs().max()))
        checked.add((r, attempt, s))
    return checked


def check_residuals(c: Codec, recs: list[dict[str, Any]], start: dict[int, torch.Tensor] | None = None) -> None:
    """One rank's residual chain: each exchange encodes its pseudo-gradient plus the residual the
    last exchange that returned left (``start`` before the first: none, or a checkpoint's), never a
    failed attempt's; the residual it leaves is exactly what its encodings dropped, or unchanged
    when the region rejoined (it sent zeros)."""
    last = dict(start or {})
    for e in recs:
        for s, sh in e["shards"].items():
            assert _same(sh["before"], last.get(s)), (e["r"], e["attempt"], s)
            if sh["fresh"]:
                assert not bool(sh["x"].any()) and _same(sh["after"], sh["before"]), (e["r"], s)
            else:
                assert torch.equal(sh["after"], sh["x"] - _sent(c, sh["x"], sh["cuts"])), (e["r"], e["attempt"], s)
        if e["ok"]:
            last.update({s: sh["after"] for s, sh in e["shards"].items()})


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("WARNING")]


@pytest.mark.slow
def test_int8_with_outer_overlap_sums_every_round_exactly_as_by_hand_and_carries_each_residual(tmp_path: Path) -> None:
    """--outer-overlap 2 with H=4: each round's exchange runs in a thread while the ranks go on
    training; its int8 sum is still the codec-only computation bit for bit, on 3 regions."""
    members = "us-east-1:1,eu-west-1:2,ap-southeast-1:1"
    logs = run_ranks("overlap", members, tmp_path, "int8")
    names = ["us-east-1-0", "eu-west-1-0", "eu-west-1-1", "ap-southeast-1-0"]
    c = codec("int8")
    for name in names:
        recs = rounds_of(tmp_path, name)
        assert [r["round"] for r in recs] == [1, 2, 3, 4, 5], name
        for r in recs:
            assert r["regions"] == ["us-east-1", "eu-west-1", "ap-southeast-1"] and r["compression"] == "int8", (name, r)
            assert not r["adopted"] and "left_out" not in r and r["store_bytes"] < 100_000, (name, r)
            assert r["applied_step"] == min(r["step"] + 2, 20), (name, r)  # taken 2 steps late; the last at the end
        assert _warnings(logs[name]) == [] and "Traceback" not in logs[name], logs[name][-2000:]
        ex = exchanges(tmp_path, name)
        assert [(e["r"], e["attempt"], e["ok"]) for e in ex] == [(r, 0, True) for r in range(1, 6)], name
        check_residuals(c, ex)
    # 5 rounds, S = 2 shards
    assert check_sums(c, {name: exchanges(tmp_path, name) for name in names}) == {(r, 0, s) for r in range(1, 6) for s in (0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_chunks_of_fewer_values_than_regions_sum_exactly_on_unequal_regions(name: str, tmp_path: Path) -> None:
    """A 7-parameter model on us-east-1:1, eu-west-1:3, ap-southeast-1:2 (S = 3 shards of 3, 2 and 2
    values, 2 chunks each with 4 streams): parts of one value and empty parts, which carry no bytes
    and no digest, on the codec's path all the same."""
    members = "us-east-1:1,eu-west-1:3,ap-southeast-1:2"
    logs = run_ranks("tiny", members, tmp_path, name)
    ranks = {g: int(n) for g, n in (x.split(":") for x in members.split(","))}
    names = [f"{g}-{k}" for g, n in ranks.items() for k in range(n)]
    c = codec(name)
    for who in names:
        recs = rounds_of(tmp_path, who)
        assert [r["round"] for r in recs] == [1, 2, 3, 4], who
        for r in recs:
            assert r["regions"] == list(ranks) and not r["adopted"] and "left_out" not in r, (who, r)
            assert r.get("refused", 0) == 0, (who, r)
        assert _warnings(logs[who]) == [] and "Traceback" not in logs[who], logs[who][-2000:]
        check_residuals(c, exchanges(tmp_path, who))
    for r in range(4):  # every rank of every region holds the same parameters after each round
        assert len({rounds_of(tmp_path, who)[r]["digest"] for who in names}) == 1, r
    logs_ex = {who: exchanges(tmp_path, who) for who in names}
    assert check_sums(c, logs_ex) == {(r, 0, s) for r in range(1, 5) for s in range(3)}
    sizes = {b - a for recs in logs_ex.values() for e in recs for sh in e["shards"].values() for chunk in sh["cuts"] for a, b in chunk}
    assert {0, 1} <= sizes, sizes  # the case under test: empty parts and parts of one value
    assert any(bool(sh["sum"].any()) for e in logs_ex["us-east-1-0"] for sh in e["shards"].values())


@pytest.mark.slow
@pytest.mark.parametrize("resumed", [True, False])
def test_a_region_killed_under_int8_rejoins_peer_to_peer_with_its_checkpointed_residual_and_the_redo_counts_each_once(
    resumed: bool, tmp_path: Path
) -> None:
    """ap-southeast-1 is SIGKILLed in round 3's exchange and started again: the survivors redo round
    3 from the residual round 2 left (not the failed attempt's), ap-southeast-1 takes the fp32 state
    peer to peer, sends zeros in that round keeping its residual (its checkpoint's when resumed,
    none after a plain restart), and from then on the rounds tables, the parameters and every int8
    sum agree."""
    store = host_store("127.0.0.1", timeout_s=60)
    members = "us-east-1:1,eu-west-1:2,ap-southeast-1:1"
    procs = start_ranks("rejoin", members, tmp_path, "int8", store.port)
    ap = procs.pop("ap-southeast-1-0")
    try:
        assert ap.wait(timeout=300) == -9, "\n".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
        for suffix in ("log", "ex.pt"):
            (tmp_path / f"ap-southeast-1-0.{suffix}").rename(tmp_path / f"ap-southeast-1-0.first.{suffix}")
        saved = tmp_path / "ap-southeast-1.ckpt.pt"
        if not resumed:  # a plain restart: no checkpoint to load
            saved = saved.rename(tmp_path / "ap-southeast-1.kept.pt")
        with (tmp_path / "ap-southeast-1-0.log").open("w") as log:
            procs["ap-southeast-1-0"] = subprocess.Popen([*ap.args, "again"], stdout=log, stderr=subprocess.STDOUT, text=True)  # type: ignore[misc]
        codes = {name: p.wait(timeout=300) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {f.name.removesuffix(".log"): f.read_text() for f in tmp_path.glob("*.log")}
    assert set(codes.values()) == {0}, (codes, "\n".join(v[-3000:] for v in logs.values()))
    all3 = ["us-east-1", "eu-west-1", "ap-southeast-1"]
    us = {r["round"]: r for r in rounds_of(tmp_path, "us-east-1-0")}
    assert sorted(us) == list(range(1, 11))
    ap_recs = rounds_of(tmp_path, "ap-southeast-1-0")
    assert [r["round"] for r in ap_recs[:2]] == [1, 2]  # before the kill
    late = [r for r in ap_recs[2:] if "ap-southeast-1" not in r["regions"]]
    back = ap_recs[2 + len(late) :]
    assert len(late) <= 1 and not any(r["adopted"] for r in late), late
    assert back and back[0]["adopted"] and all(not r["adopted"] for r in back[1:]), back
    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1", "ap-southeast-1-0"):
        for r in rounds_of(tmp_path, name):  # the rounds tables agree, and the state never went through the store
            assert r["regions"] == us[r["round"]]["regions"] or (name.startswith("ap") and r in late), (name, r)
            assert "left_out" not in r and r["store_bytes"] < 100_000, (name, r)  # the fp32 state is 336 kB
            if name.rsplit("-", 1)[0] in r["regions"]:  # a member holds the round's parameters, as every member does
                assert r["digest"] == us[r["round"]]["digest"], (name, r)
    assert us[1]["regions"] == us[2]["regions"] == all3 and us[3]["regions"] == all3[:2] and us[3]["missing"] == [all3[2]]
    assert all(us[r]["regions"] == all3 for r in range(back[0]["round"], 11))
    redo = "WARNING geoshard.trainer.diloco.p2p: DiLoCo: outer round 3 attempt 0 among us-east-1, eu-west-1, ap-southeast-1 failed ("
    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1"):
        warned = _warnings(logs[name])
        assert len(warned) == 1 and warned[0].startswith(redo), warned
        assert "Traceback" not in logs[name]
    missed = "WARNING geoshard.trainer.diloco.p2p: DiLoCo: region ap-southeast-1 missed outer round {}; it keeps its own parameters for it"
    assert _warnings(logs["ap-southeast-1-0"]) == [missed.format(r["round"]) for r in late]
    assert "Traceback" not in logs["ap-southeast-1-0"]

    c = codec("int8")
    ex = {name: exchanges(tmp_path, name) for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1", "ap-southeast-1-0")}
    ex["ap-southeast-1-0.first"] = exchanges(tmp_path, "ap-southeast-1-0.first")
    failed = [(name, e["r"]) for name, recs in ex.items() for e in recs if not e["ok"]]
    assert failed and all(r == 3 for _, r in failed), failed  # the survivors' attempt the kill broke, after they encoded
    for name in ("us-east-1-0", "eu-west-1-0", "eu-west-1-1", "ap-southeast-1-0.first"):
        check_residuals(c, ex[name])
    ckpt = torch.load(saved)["residual"]
    assert float(ckpt.abs().max()) > 0
    assert torch.equal(ckpt, torch.cat([ex["ap-southeast-1-0.first"][1]["shards"][s]["after"] for s in (0, 1)]))  # round 2's
    numel = ckpt.numel()
    check_residuals(c, ex["ap-southeast-1-0"], {s: ckpt[slice(*span(numel, 2, s))] for s in (0, 1)} if resumed else None)
    mine = [e for e in ex["ap-southeast-1-0"] if e["ok"]]
    assert mine[0]["r"] == back[0]["round"] and all(sh["fresh"] for sh in mine[0]["shards"].values())
    assert len(mine) >= 2 and not any(sh["fresh"] for sh in mine[1]["shards"].values())
    checked = check_sums(c, ex)
    assert {r for r, _, _ in checked} == set(range(1, 11)) and (3, 1, 0) in checked, sorted(checked)  # round 3: its redo


@pytest.mark.slow
def test_geoshard_train_with_int8_and_outer_overlap_takes_each_round_k_steps_late_without_a_warning(tmp_path: Path) -> None:
    regions = f"{US}:1,{EU}:2"
    out, done = _train(tmp_path, "int8", regions, "--outer-overlap", 4)  # no warning on stderr (checked there)
    for region, n in ((US, 1), (EU, 2)):
        inner = "DDP in the region" if n > 1 else "one rank in the region, no DDP"
        start = (
            f"geoshard.trainer: {region}: {n} of the job's 3 rank(s); {inner}, DiLoCo across {regions} every 10 steps "
            "(outer lr 0.7, momentum 0.9, Nesterov, int8; peer to peer, sharded over every rank, 2 streams)"
        )
        assert start in done.stdout.splitlines(), done.stdout[:3000]
        rounds = [r for r in lines(out / f"rounds-{region}.jsonl") if r["event"] == "round"]
        assert [r["round"] for r in rounds] == [1, 2, 3, 4]
        for r in rounds:
            assert r["compression"] == "int8" and r["transport"] == "p2p" and r["regions"] == [US, EU], r
            assert not r["adopted"] and r["missing"] == [] and "left_out" not in r and r.get("refused", 0) == 0, r
            assert r["applied_step"] == min(r["step"] + 4, 40) and 0 < r["store_bytes"] < 1_000_000, r
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] and report["outer"]["compression"] == "int8"
    assert report["loss_last"] < report["loss_first"] - 0.05, (report["loss_first"], report["loss_last"])
    latest = CheckpointStore(str(out / "checkpoints" / EU), keep=2).load_latest()
    assert latest is not None and latest[0] == 40
    fb = latest[1]["outer"]["feedback"]
    assert fb["codec"] == "int8" and float(fb["residual"].abs().max()) > 0
