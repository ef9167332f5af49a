"""The linear MAC of the peer-to-peer exchange (trainer/diloco/mac.py): honest sums pass, changed
ones (sparse, paired, spread) are refused, the codes are the same bits in every process whatever
its thread count or device, and codes kept between a publish and its check stay within their bound."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from geoshard.trainer.diloco import mac
from geoshard.trainer.diloco.auth import Refused, Signer

SIGNER = Signer(b"mac-test-secret-0123456789abcdefgh")


def contributions(m: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 1e-3 for _ in range(m)]


def ring_sum(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The sum as gloo's ring adds it: in the compression's dtype, m - 1 rounded additions."""
    y = xs[0].to(dtype).clone()
    for x in xs[1:]:
        y += x.to(dtype)
    return y


def published(xs: list[torch.Tensor], dtype: torch.dtype, tag: str, s: int = 0) -> list[list[float]]:
    return [mac.decode_projections(mac.encode_projections(mac.project(SIGNER, tag, s, x.to(dtype))).encode()) for x in xs]


@pytest.mark.parametrize(("compression", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("none", torch.float32)])
def test_an_honest_sum_passes_well_inside_the_bound(compression: str, dtype: torch.dtype) -> None:
    worst = 0.0
    for seed, (m, n) in enumerate([(2, 1000), (3, 100_003), (3, mac.CHUNK + 17)]):
        xs = contributions(m, n, seed)
        pub = published(xs, dtype, f"honest/{seed}")
        y = ring_sum([x.to(dtype) for x in xs], dtype)
        mac.check(SIGNER, f"honest/{seed}", 0, y, pub, compression)  # raises if refused
        got = mac.project(SIGNER, f"honest/{seed}", 0, y)
        tol = mac.tolerance(pub, compression, n, got[mac.K])
        worst = max(worst, *(abs(got[i] - sum(p[i] for p in pub)) / tol for i in range(mac.K)))
    assert 0 < worst < 0.2, worst  # the rounding is a few percent of the bound, not zero (the sums were rounded)


def changed(kind: str, y: torch.Tensor, tol: float) -> torch.Tensor:
    d = torch.zeros_like(y, dtype=torch.float32)
    if kind == "one value":
        d[12345] = 2 * tol
    elif kind == "a pair that cancels in half the signs":
        d[7], d[70_007] = 2 * tol, -2 * tol
    else:  # spread: every value changed by less than the bound, the norm 5x the bound
        d += 5 * tol / y.numel() ** 0.5
    return (y.float() + d).to(y.dtype)


@pytest.mark.parametrize("kind", ["one value", "a pair that cancels in half the signs", "spread"])
def test_a_changed_sum_is_refused_for_every_seed(kind: str) -> None:
    xs = contributions(3, 200_000, 7)
    for seed in range(12):  # a vector passes at most half the time: 12 seeds x 15 vectors
        tag = f"changed/{seed}"
        pub = published(xs, torch.float16, tag)
        y = ring_sum([x.half() for x in xs], torch.float16)
        tol = mac.tolerance(pub, "fp16", y.numel(), mac.project(SIGNER, tag, 0, y)[mac.K])
        with pytest.raises(Refused) as e:
            mac.check(SIGNER, tag, 0, changed(kind, y, tol), pub, "fp16")
        assert e.value.kind == "unauthenticated" and "its projection" in e.value.reason


def test_a_sum_that_is_not_finite_is_refused_and_malformed_projections_too() -> None:
    xs = contributions(2, 1000, 1)
    pub = published(xs, torch.float16, "nan")
    y = ring_sum([x.half() for x in xs], torch.float16)
    y[3] = float("nan")
    with pytest.raises(Refused, match="1 of the sum's 1000 values are NaN or infinite"):
        mac.check(SIGNER, "nan", 0, y, pub, "fp16")
    for bad in (b"1 2 3", b"x " * (mac.K + 1), " ".join(["1"] * mac.K + ["-1"]).encode(), " ".join(["nan"] * (mac.K + 1)).encode()):
        with pytest.raises(Refused, match=f"not {mac.K + 1} finite projections"):
            mac.decode_projections(bad)


def test_another_round_attempt_or_shard_gets_other_codes() -> None:
    x = torch.randn(5000)
    a, b, c = (mac.project(SIGNER, tag, s, x) for tag, s in (("r/1/0", 0), ("r/1/1", 0), ("r/1/0", 1)))
    assert a[mac.K] == b[mac.K] == c[mac.K]  # the same norm
    assert a[: mac.K] != b[: mac.K] and a[: mac.K] != c[: mac.K]
    other = Signer(b"another-job-secret-0123456789abcdef")
    assert mac.project(other, "r/1/0", 0, x)[: mac.K] != a[: mac.K]


CODES = """
import hashlib, sys, torch
from geoshard.trainer.diloco import mac
from geoshard.trainer.diloco.auth import Signer
torch.set_num_threads(int(sys.argv[1]))
signer = Signer(b"mac-test-secret-0123456789abcdefgh")
h = hashlib.sha256()
for codes in mac._draw(mac._seeds(signer, "r/3/0", 2), mac.CHUNK + 1001, torch.device("cpu")):
    h.update(codes.numpy().tobytes())
x = torch.arange(mac.CHUNK + 1001, dtype=torch.float32).sin()
print(h.hexdigest(), mac.encode_projections(mac.project(signer, "r/3/0", 2, x)), torch.cuda.is_available())
"""


def test_the_codes_are_the_same_bits_in_two_processes_without_cuda_whatever_their_threads() -> None:
    outs = []
    for threads in (1, 2):
        env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
        p = subprocess.run([sys.executable, "-P", "-c", CODES, str(threads)], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout.split(" "))
    assert outs[0][0] == outs[1][0] and len(outs[0][0]) == 64
    assert outs[0][-1].strip() == outs[1][-1].strip() == "False"  # no CUDA in either
    here = hashlib.sha256()
    for codes in mac._draw(mac._seeds(SIGNER, "r/3/0", 2), mac.CHUNK + 1001, torch.device("cpu")):
        assert codes.dtype == torch.int16 and int(codes.min()) >= 0 and int(codes.max()) < 1 << mac.K
        here.update(codes.numpy().tobytes())
    assert here.hexdigest() == outs[0][0]
    # the same projections to float64 rounding (the bucket sums may add in another order)
    p1, p2 = ([float(v) for v in o[1:-1]] for o in outs)
    assert all(abs(a - b) <= 1e-9 * abs(p1[-1]) for a, b in zip(p1, p2, strict=True))


def test_the_codes_are_balanced_and_the_bits_independent() -> None:
    codes = torch.cat(list(mac._draw(mac._seeds(SIGNER, "balance", 0), 1 << 20, torch.device("cpu"))))
    bits = ((codes.unsqueeze(1) >> torch.arange(mac.K)) & 1).float()
    share = bits.mean(0)
    assert float((share - 0.5).abs().max()) < 0.003  # 1M values: 6 standard deviations
    corr = torch.corrcoef(bits.T) - torch.eye(mac.K)
    assert float(corr.abs().max()) < 0.006


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_a_cuda_shard_gets_the_cpu_codes() -> None:
    x = torch.randn(mac.CHUNK + 99)
    cpu = mac.project(SIGNER, "cuda", 0, x)
    gpu = mac.project(SIGNER, "cuda", 0, x.cuda())
    assert all(abs(a - b) <= 1e-9 * cpu[-1] for a, b in zip(cpu, gpu, strict=True))


def test_codes_kept_for_the_check_are_used_once_and_stay_within_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(10_000)
    fresh = mac.project(SIGNER, "keep", 0, x)
    assert len(mac.KEPT) == 0
    assert mac.project(SIGNER, "keep", 0, x, keep=True) == fresh and len(mac.KEPT) == 1
    assert mac.project(SIGNER, "keep", 0, x) == fresh and len(mac.KEPT) == 0  # the check took them
    monkeypatch.setattr(mac, "KEEP_BYTES", 3 * 2 * 10_000)
    for s in range(4):  # the fourth does not fit beside three: the oldest goes
        mac.project(SIGNER, "keep", s, x, keep=True)
    assert len(mac.KEPT) == 3
    assert mac.KEPT.take(((*mac._seeds(SIGNER, "keep", 0),), 10_000, "cpu")) is None
    mac.project(SIGNER, "keep", 9, torch.randn(40_000), keep=True)  # larger than the bound: not kept
    assert len(mac.KEPT) == 3
    for s in (1, 2, 3):
        assert mac.project(SIGNER, "keep", s, x) == mac.project(SIGNER, "keep", s, x)
    assert len(mac.KEPT) == 0


def test_a_projection_fed_in_pieces_is_the_one_pass_projection_and_checks_alike() -> None:
    xs = contributions(3, 3 * mac.CHUNK // 2 + 77, seed=5)  # pieces that cross a code piece's edge
    y = ring_sum(xs, torch.float16)
    pub = published(xs, torch.float16, "pieces")
    whole = mac.project(SIGNER, "pieces", 0, y)
    fed = mac.Projector(SIGNER, "pieces", 0, y.numel(), y.device)
    for a, b in ((0, 1000), (1000, mac.CHUNK + 5), (mac.CHUNK + 5, y.numel())):
        fed.add(y[a:b])
    got = fed.result()
    assert all(abs(g - w) <= 1e-12 * whole[-1] for g, w in zip(got, whole, strict=True)), (got, whole)
    mac.check_projected(got, y, pub, "fp16")  # the honest sum passes
    changed = y.clone()
    changed[mac.CHUNK + 3] += 1.0
    bad = mac.Projector(SIGNER, "pieces", 0, y.numel(), y.device)
    bad.add(changed[: mac.CHUNK])
    bad.add(changed[mac.CHUNK :])
    with pytest.raises(Refused, match="projection"):
        mac.check_projected(bad.result(), changed, pub, "fp16")
    short = mac.Projector(SIGNER, "pieces", 0, 10, y.device)
    short.add(y[:4])
    with pytest.raises(ValueError, match="fed 4"):
        short.result()
    with pytest.raises(ValueError, match="fed to a projection of 10"):
        short.add(y[:7])


def test_a_projector_takes_the_codes_the_publish_kept() -> None:
    x = torch.randn(20_000)
    fresh = mac.project(SIGNER, "kept-fed", 3, x)
    mac.project(SIGNER, "kept-fed", 3, x, keep=True)
    assert len(mac.KEPT) == 1
    fed = mac.Projector(SIGNER, "kept-fed", 3, x.numel(), x.device)
    assert len(mac.KEPT) == 0  # taken, used once
    fed.add(x[:12_345])
    fed.add(x[12_345:])
    assert all(abs(g - w) <= 1e-12 * fresh[-1] for g, w in zip(fed.result(), fresh, strict=True))
