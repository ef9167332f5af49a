"""Issue 23 part 5: the pseudo-gradient codecs (``trainer/diloco/codec.py``) and error feedback.

fp16 / bf16 / none stay byte for byte what the store carried before; int8 and fp8 take about half
of fp16's bytes with a stated error bound per block; every payload's size is exact; non-finite
input is refused, and so is a malformed payload; error feedback keeps the running sum of what was
sent within one round's error of the running sum of the pseudo-gradients; its residual survives a
checkpoint and is checked when loaded. The end-to-end run is ``geoshard train --outer-compression
int8`` in a subprocess."""

from __future__ import annotations

import io
import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_diloco_train import EU, US, lines, local_plan, train_argv

from geoshard.errors import ConfigError, GeoshardError
from geoshard.trainer.checkpoint import CheckpointStore
from geoshard.trainer.config import TrainConfig
from geoshard.trainer.diloco import OuterSync, checks
from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.codec import BLOCK, CODECS, ErrorFeedback, NonFinite, codec, unusable
from geoshard.trainer.model import Net

TINY = 2.0**-149  # the smallest fp32 subnormal: the finest any fp32 result can be
SIZES = (1, 1023, 1024, 1025, 3 * BLOCK + 7)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """Per value, the absmax of its block."""
    n = x.numel()
    nb = math.ceil(n / BLOCK)
    absmax = torch.nn.functional.pad(x.abs(), (0, nb * BLOCK - n)).view(nb, BLOCK).amax(dim=1)
    return absmax.repeat_interleave(BLOCK)[:n]


def _bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The error bound docs/diloco.md states, per value."""
    a = _blocks(x)
    if name == "int8":
        return a / 254 + a * 2.0**-22 + TINY
    return x.abs() / 16 + a * 2.0**-18 + TINY  # fp8 e4m3: 3 mantissa bits; its subnormals below 2**-6 of 448


def _random(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (n,), generator=g).float()


KINDS: dict[str, Callable[[int, torch.Generator], torch.Tensor]] = {
    "random": _random,
    "zero": lambda n, g: torch.zeros(n),
    "constant": lambda n, g: torch.full((n,), -0.37),
    "huge": lambda n, g: torch.randn(n, generator=g).clamp(-1, 1) * 3e38,
    "tiny": lambda n, g: torch.randn(n, generator=g).clamp(-1, 1) * 2.0**-140,  # fp32 subnormals
    "one-spike": lambda n, g: torch.nn.functional.one_hot(torch.tensor(n // 2), n).float() * 5.0 + 1e-4,
}


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("kind", KINDS)
def test_int8_and_fp8_round_trips_stay_within_the_stated_bound(name: str, kind: str) -> None:
    c = codec(name)
    g = torch.Generator().manual_seed(7)
    for n in SIZES:
        x = KINDS[kind](n, g)
        assert torch.isfinite(x).all()
        payload = c.encode(x)
        assert len(payload) == c.nbytes(n) == n + 4 * math.ceil(n / BLOCK)
        back = c.decode(payload, n)
        assert back.dtype == torch.float32 and back.shape == (n,)
        err = (back - x).abs()
        over = err > _bound(name, x)
        assert not over.any(), (n, x[over][:5], back[over][:5])
        if kind == "zero":
            assert torch.equal(back, x)
        if kind == "constant":  # the absmax itself is sent exactly
            assert torch.equal(back, x)
    # Not a bound met by doing nothing: int8 is at least 60x finer than the block's absmax on random data.
    x = torch.randn(10 * BLOCK, generator=g)
    err = (c.decode(c.encode(x), x.numel()) - x).abs().max()
    assert 0 < err <= _blocks(x).max() / (254 if name == "int8" else 16)


@pytest.mark.parametrize("name", ["fp16", "bf16", "none"])
def test_fp16_bf16_and_fp32_are_byte_for_byte_the_cast_sent_before(name: str) -> None:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": torch.float32}[name]
    x = torch.randn(3001, generator=torch.Generator().manual_seed(1))
    c = codec(name)
    payload = c.encode(x)
    assert payload == x.to(dtype).view(torch.uint8).numpy().tobytes()  # what settings.encode sent before codecs
    assert len(payload) == c.nbytes(3001) == 3001 * dtype.itemsize
    assert torch.equal(c.decode(payload, 3001), x.to(dtype).float())
    assert c.summable


def test_payload_sizes_are_exact_and_int8_takes_about_half_of_fp16s() -> None:
    for n in (0, *SIZES, 10**6):
        x = torch.ones(n)
        for name, c in CODECS.items():
            assert len(c.encode(x)) == c.nbytes(n), (name, n)
    n = Net(256)
    numel = sum(p.numel() for p in n.parameters())
    ratio = codec("int8").nbytes(numel) / codec("fp16").nbytes(numel)
    assert 0.5 < ratio < 0.503, ratio
    assert codec("fp8").nbytes(numel) == codec("int8").nbytes(numel)
    assert not codec("int8").summable and not codec("fp8").summable


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_with_one_clear_error(name: str, bad: float) -> None:
    x = torch.ones(2000)
    x[1500] = bad
    with pytest.raises(NonFinite) as e:
        codec(name).encode(x)
    assert str(e.value) == "1 of the pseudo-gradient's 2000 values are NaN or infinite: nothing to encode"
    assert isinstance(e.value, GeoshardError) and e.value.exit_code == 1


def _refused(payload: bytes, name: str, numel: int) -> Refused:
    with pytest.raises(Refused) as e:
        codec(name).decode(payload, numel)
    # checks.grad, which every leader runs on what it reads, refuses it the same way
    with pytest.raises(Refused) as again:
        checks.grad(payload, checks.Bounds(numel, name))
    assert again.value.kind == e.value.kind
    return e.value


@pytest.mark.parametrize("name", list(CODECS))
def test_a_payload_of_another_size_is_refused_naming_both_sizes(name: str) -> None:
    n = 2 * BLOCK + 5
    good = codec(name).encode(torch.randn(n))
    want = codec(name).nbytes(n)
    for payload in (good[:-1], good + b"\0", b"", good + good):
        e = _refused(payload, name, n)
        assert (e.kind, e.reason) == ("malformed", f"{len(payload)} bytes, the model's {n} {name} values take {want}")


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_bad_scales_and_codes_are_refused(name: str) -> None:
    n = 2 * BLOCK + 5
    good = bytearray(codec(name).encode(torch.randn(n)))
    cases = {
        "nan scale": (struct_f32(float("nan")), 4, "non-finite", f"1 of its 3 {name} block scales are NaN or infinite"),
        "inf scale": (struct_f32(float("inf")), 0, "non-finite", f"1 of its 3 {name} block scales are NaN or infinite"),
        "negative scale": (struct_f32(-1.0), 8, "malformed", f"1 of its 3 {name} block scales are negative"),
    }
    if name == "int8":
        cases["code -128"] = (b"\x80", 12 + 9, "malformed", "1 of its int8 codes are -128 (never encoded)")
    else:
        cases["nan code"] = (b"\x7f", 12 + 9, "non-finite", f"1 of its {n} fp8 values are NaN")
    for what, (raw, at, kind, reason) in cases.items():
        payload = bytes(good[:at] + raw + good[at + len(raw) :])
        e = _refused(payload, name, n)
        assert (e.kind, e.reason) == (kind, reason), what
    # A region's own non-finite pseudo-gradient goes out as a value every leader refuses as non-finite
    # (fp16/bf16/fp32 decode as before, NaN included: checks.grad refuses it).
    for c in CODECS.values():
        payload = unusable(c, n)
        assert len(payload) == c.nbytes(n)
        with pytest.raises(Refused) as e:
            checks.grad(payload, checks.Bounds(n, c.name))
        assert e.value.kind == "non-finite", c.name


def struct_f32(v: float) -> bytes:
    return torch.tensor([v], dtype=torch.float32).view(torch.uint8).numpy().tobytes()


def _drift(name: str, feedback: bool, deltas: list[torch.Tensor], where: torch.Tensor) -> list[float]:
    """max |sum of the deltas - sum of what was decoded| after each round, over the values ``where``."""
    c = codec(name)
    ef = ErrorFeedback(c, deltas[0].numel(), enabled=feedback)
    want, got, out = torch.zeros_like(deltas[0]), torch.zeros_like(deltas[0]), []
    for d in deltas:
        want += d
        got += c.decode(ef.encode(d), d.numel())
        out.append(float((want - got)[where].abs().max()))
    return out


@pytest.mark.parametrize("name", ["int8", "fp8", "fp16"])
def test_error_feedback_keeps_the_running_sum_on_track_and_without_it_the_drift_grows(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    n = 3 * BLOCK + 100
    # Each round: a few large values and many small ones (a pseudo-gradient's usual spread), with a
    # bias the small ones share, which rounding to the block's scale drops every round.
    base = torch.full((n,), 1e-3 if name != "fp16" else 1e-7)
    spikes = torch.zeros(n, dtype=torch.bool)
    spikes[:: BLOCK // 4] = True
    deltas = []
    for _ in range(100):
        d = base + torch.randn(n, generator=g) * (1e-4 if name != "fp16" else 1e-8)
        d[spikes] = torch.randn(int(spikes.sum()), generator=g)
        deltas.append(d)
    everywhere = torch.ones(n, dtype=torch.bool)
    one_round = max(float((_bound(name, d) if name != "fp16" else d.abs() * 2.0**-11 + 2.0**-25).max()) for d in deltas) * 2
    with_ef = _drift(name, True, deltas, everywhere)
    assert max(with_ef) <= one_round, (max(with_ef), one_round)  # bounded: never more than about one round's error
    # On the small values, which rounding to their block's scale biases the same way every round:
    small_ef, small = _drift(name, True, deltas, ~spikes), _drift(name, False, deltas, ~spikes)
    assert small[-1] > 10 * max(small_ef), (small[-1], max(small_ef))
    assert small[-1] > 3 * small[9]  # without feedback the drift keeps growing; with it, it stays bounded


def test_error_feedback_survives_a_checkpoint_and_is_checked_when_loaded(tmp_path: Path) -> None:
    c, n = codec("int8"), 2 * BLOCK + 3
    g = torch.Generator().manual_seed(5)
    deltas = [torch.randn(n, generator=g) for _ in range(6)]
    a = ErrorFeedback(c, n)
    for d in deltas[:3]:
        a.encode(d)
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2)
    store.save(3, {"outer": {"feedback": a.state_dict()}})
    loaded = store.load_latest()
    assert loaded is not None
    b = ErrorFeedback(c, n)
    b.load_state_dict(loaded[1]["outer"]["feedback"])
    assert b.residual is not None and a.residual is not None and torch.equal(a.residual, b.residual)
    assert float(b.residual.abs().max()) > 0
    assert [a.encode(d) for d in deltas[3:]] == [b.encode(d) for d in deltas[3:]]  # the same bytes from then on

    fresh = ErrorFeedback(c, n)
    ok = b.state_dict()
    bad_cases = {
        "shape": ({**ok, "residual": torch.zeros(n - 1)}, "malformed", f"torch.float32 ({n - 1},), the model's is torch.float32 ({n},)"),
        "dtype": ({**ok, "residual": torch.zeros(n, dtype=torch.float16)}, "malformed", "torch.float16"),
        "type": ({**ok, "residual": [0.0] * n}, "malformed", "is list"),
        "nan": ({**ok, "residual": torch.full((n,), float("nan"))}, "non-finite", f"{n} of the error feedback residual's {n} values"),
        "keys": ({"residual": ok["residual"]}, "malformed", "not {codec, residual}"),
    }
    for what, (state, kind, reason) in bad_cases.items():
        with pytest.raises(Refused) as e:
            fresh.load_state_dict(state)
        assert e.value.kind == kind and reason in e.value.reason, what
        assert fresh.residual is None, what  # nothing half-loaded
    other = ErrorFeedback(codec("fp8"), n)
    other.load_state_dict(ok)  # another codec's rounding errors: dropped
    assert other.residual is None
    lossless = ErrorFeedback(codec("none"), n)
    lossless.encode(deltas[0])
    assert lossless.residual is None and not lossless.enabled


def test_int8_and_fp8_are_accepted_where_the_compression_is_chosen_and_others_named() -> None:
    for name in ("int8", "fp8"):
        assert OuterSync(compression=name).compression == name
        cfg = TrainConfig(plan=Path("p.toml"), out=Path("o"), steps=1, outer_compression=name, outer_error_feedback=False)
        assert ["--outer-compression", name] == cfg.to_argv()[cfg.to_argv().index("--outer-compression") :][:2]
        assert "--no-outer-error-feedback" in cfg.to_argv()
    with pytest.raises(ConfigError) as e:
        OuterSync(compression="int4")
    assert str(e.value) == "outer compression must be one of fp16, bf16, none, int8, fp8, got 'int4'"


@pytest.mark.slow
def test_geoshard_train_with_int8_pseudo_gradients_sends_about_half_of_fp16s_bytes(tmp_path: Path) -> None:
    plan = local_plan(tmp_path, {US: 1, EU: 1}, samples=2000)
    out = tmp_path / "run"
    steps, h, hidden = 40, 10, 256
    argv = train_argv(plan, out, f"{US}:1,{EU}:1", "--steps", steps, "--outer-steps", h, "--hidden", hidden, "--outer-compression", "int8")
    argv += ["--checkpoint-every", "20", "--outer-transport", "store"]  # int8 blocks carry scales: only the store transport sums them
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    for region in (US, EU):
        assert (
            f"geoshard.trainer: {region}: 1 of the job's 2 rank(s); one rank in the region, no DDP, DiLoCo across {US}:1,{EU}:1 "
            f"every {h} steps (outer lr 0.7, momentum 0.9, Nesterov, int8)"
        ) in done.stdout
    assert "(int8 pseudo-gradients)" in done.stdout  # the report's rounds caption
    numel = sum(p.numel() for p in Net(hidden).parameters())
    int8, fp16 = numel + 4 * math.ceil(numel / BLOCK), 2 * numel
    for region in (US, EU):
        rounds = [r for r in lines(out / f"rounds-{region}.jsonl") if r["event"] == "round"]
        assert [r["round"] for r in rounds] == [1, 2, 3, 4]
        for r in rounds:
            assert r["compression"] == "int8" and r["regions"] == [US, EU] and not r["adopted"]
            assert r["bytes_read"] == int8  # the other region's pseudo-gradient
            assert int8 <= r["bytes_published"] <= int8 + 8 * numel + (64 << 10)  # plus the outer state, from one region
        assert 0.5 < r["bytes_read"] / fp16 < 0.503
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] and report["outer"]["compression"] == "int8"
    assert report["loss_last"] < report["loss_first"] - 0.05, (report["loss_first"], report["loss_last"])
    assert all(x["regions"] == [US, EU] and x["missing"] == [] for x in report["outer"]["rounds"])
    # The region's checkpoint holds the leader's error feedback residual, finite and not zero.
    latest = CheckpointStore(str(out / "checkpoints" / US), keep=2).load_latest()
    assert latest is not None and latest[0] == steps
    fb = latest[1]["outer"]["feedback"]
    assert fb["codec"] == "int8" and fb["residual"].shape == (numel,)
    assert torch.isfinite(fb["residual"]).all() and float(fb["residual"].abs().max()) > 0
    buf = io.BytesIO()
    torch.save(fb, buf)  # what the residual adds to each checkpoint: one fp32 copy of the model
    assert buf.getbuffer().nbytes < 4 * numel + 4096


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_encoding_in_chunks_gives_the_same_bytes_as_in_one_pass(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large models are encoded a few thousand blocks at a time (bounded temporaries): the chunk
    boundaries change nothing, also where the last block is partial."""
    from geoshard.trainer.diloco import codec as module

    c = codec(name)
    x = _random(7 * BLOCK + 300, torch.Generator().manual_seed(11))  # 8 blocks, the last partial
    whole = c.encode(x)
    back = c.decode(whole, x.numel())
    monkeypatch.setattr(module, "CHUNK_BLOCKS", 3)  # chunks of 3, 3 and 2 blocks
    assert c.encode(x) == whole
    assert torch.equal(c.decode(whole, x.numel()), back)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("numel", SIZES)
def test_roundtrip_gives_the_payload_and_exactly_what_decoding_it_gives(name: str, numel: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Error feedback takes its residual from ``roundtrip`` instead of decoding its own payload:
    the same bytes as ``encode``, and the same floats as ``decode`` of them, bit for bit but for
    a zero's sign (chunked too, with a block of zeros and values at fp32's ends)."""
    from geoshard.trainer.diloco import codec as module

    c = codec(name)
    x = _random(numel, torch.Generator().manual_seed(numel))
    x[: min(numel, BLOCK)] = 0.0
    if numel > BLOCK + 1:
        x[BLOCK] = 3e38 if name in ("none", "int8", "fp8") else 6e4
        x[BLOCK + 1] = TINY
    for chunk_blocks in (module.CHUNK_BLOCKS, 1):
        monkeypatch.setattr(module, "CHUNK_BLOCKS", chunk_blocks)
        payload, back = c.roundtrip(x)
        assert payload == c.encode(x)
        want = c.decode(payload, numel)
        assert back.dtype == torch.float32 and back.shape == (numel,)
        assert torch.equal(back, want)  # the same floats; an int8 zero may come back as -0.0 (equal)
        assert torch.equal(back.view(torch.int32) & 0x7FFFFFFF, want.view(torch.int32) & 0x7FFFFFFF)


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "fp8"])  # the codecs that hold 3e38
def test_finite_values_whose_sum_overflows_are_not_taken_for_non_finite_ones(name: str) -> None:
    """The finiteness check is one sum; a sum that overflows (fp32's largest values) is counted
    again exactly and encodes, where one NaN among them is refused with its count."""
    big = torch.full((3000,), 3.0e38)
    assert not math.isfinite(float(big.sum()))
    payload = codec(name).encode(big)
    assert torch.isfinite(codec(name).decode(payload, big.numel())).all()
    big[7] = float("nan")
    with pytest.raises(NonFinite) as e:
        codec(name).encode(big)
    assert str(e.value) == "1 of the pseudo-gradient's 3000 values are NaN or infinite: nothing to encode"
