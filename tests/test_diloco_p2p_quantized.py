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

import pytest
import torch
from test_diloco_codec import _bound
from test_diloco_train import EU, US, lines, local_plan, train_argv

from geoshard.trainer.checkpoint import CheckpointStore
from geoshard.trainer.diloco import OuterSync, host_store
from geoshard.trainer.diloco.codec import BLOCK, codec
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


def run_ranks(mode: str, members: str, out: Path, compression: str) -> dict[str, str]:
    """Every rank of every region as its own process; their logs by region-rank."""
    store = host_store("127.0.0.1", timeout_s=60)
    key = out / "secret"
    key.touch(mode=0o600)
    key.write_bytes(b"q" * 32)
    procs = {}
    for spec in members.split(","):
        region, n = spec.split(":")
        region_port = _free_port()
        for k in range(int(n)):
            argv = [sys.executable, "-P", str(JOB), mode, region, str(k), str(store.port), members, compression, str(out), str(region_port)]
            with (out / f"{region}-{k}.log").open("w") as log:
                procs[f"{region}-{k}"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
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


def _train(tmp_path: Path, compression: str, regions: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=2000)
    out = tmp_path / f"run-{compression}"
    argv = train_argv(plan, out, regions, "--steps", 40, "--outer-steps", 10, "--hidden", 256, "--outer-compression", compression)
    argv += ["--checkpoint-every", "20", "--outer-transport", "p2p", "--outer-streams", "2"]
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
