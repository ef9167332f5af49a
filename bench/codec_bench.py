"""DiLoCo's pseudo-gradient codecs (issue 23, part 5): bytes per outer round and the effect on loss.

Two regions on 127.0.0.1 (``us-east-1:1,eu-west-1:1``, gloo; no rehearsal: the bytes do not depend
on the links), each reading its own local replica, train the built-in MLP (``--hidden 256``:
0.13 M parameters) with ``geoshard train --sync diloco --outer-steps 20 --steps 400`` (20 rounds)
once per codec and seed, the same samples in every run:

- ``fp16`` (the default; the baseline every ratio is against, from the same invocation),
  ``bf16``, ``none`` (fp32, lossless: how much fp16 itself costs),
- ``int8`` and ``fp8`` with error feedback (the default), and ``int8-noef``
  (``--no-outer-error-feedback``).

``--transport`` (default ``p2p``, train's default; ``store`` as the first figures were taken): over
p2p every codec goes peer to peer (int8 / fp8 as a reduce-scatter and all-gather in their own bytes,
``trainer/diloco/quantized.py``), and the bytes a region's one rank sent per round
(``bytes_published``: 2(m-1)/m of the encoded value, at m = 2 one value) stand where the store's
``bytes_read`` stood, with the store's own bytes per round beside them.

Reported per run: the pseudo-gradient bytes a region reads per round (the other region's value, from
``rounds-<region>.jsonl``'s ``bytes_read``; over p2p what it sent), the final training loss (mean of the last 10% of steps,
both regions) and the eval loss of the final model (the outer parameters after the last round, as
each region's last checkpoint holds them) on the first ``--eval-samples`` samples of each region;
per codec, the mean over seeds and each figure as a ratio to fp16's.

    .venv/bin/python bench/codec_bench.py                   # 12 runs, ~57 minutes at load ~30 (2 shared cores)
    .venv/bin/python bench/codec_bench.py --small           # smoke run, figures meaningless
    .venv/bin/python bench/codec_bench.py --transport store --codecs fp16,int8,fp8   # through the store
    .venv/bin/python bench/codec_bench.py --speed           # encode + decode time at 1M, 16M, 64M values
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REGIONS = ("us-east-1", "eu-west-1")
RANKS = ",".join(f"{r}:1" for r in REGIONS)
GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
SAMPLE_BYTES = 300
sys.path.insert(0, str(ROOT / "bench"))

from diloco_bench import eval_loss, local_plan, make_split  # noqa: E402

# name -> extra geoshard train arguments
CODECS = {
    "fp16": ["--outer-compression", "fp16"],
    "bf16": ["--outer-compression", "bf16"],
    "none": ["--outer-compression", "none"],
    "int8": ["--outer-compression", "int8"],
    "int8-noef": ["--outer-compression", "int8", "--no-outer-error-feedback"],
    "fp8": ["--outer-compression", "fp8"],
}


def one_run(name: str, seed: int, plan: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from geoshard.trainer.diloco.record import read_rounds
    from geoshard.trainer.record import read_steps

    out = work / f"run-{name}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    argv = [GEOSHARD, "train", "--plan", str(plan), "--regions", RANKS, "--out", str(out), "--sync", "diloco", "--backend", "gloo"]
    argv += ["--steps", str(args.steps), "--outer-steps", str(args.outer_steps), "--hidden", str(args.hidden), "--seed", str(seed)]
    argv += ["--batch-size", str(args.batch_size), "--lr", str(args.lr), "--num-workers", "1", "--checkpoint-every", str(args.steps)]
    argv += [*CODECS[name], "--outer-transport", args.transport]
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=work, check=False)
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"run {name} seed {seed} failed ({done.returncode}): {done.stderr[-2000:]}")
    rounds = [r for r in read_rounds(out) if r.event == "round"]
    if any(r.adopted or r.missing or r.left_out for r in rounds):
        raise RuntimeError(f"run {name} seed {seed}: a round adopted, missed or left out a region; see {out}")
    losses: list[float] = []
    for rank in range(len(REGIONS)):
        recs = read_steps(out / f"steps-rank{rank}.jsonl", rank)
        losses += [r.loss for r in recs[-max(1, len(recs) // 10) :]]
    row = {
        "codec": name,
        "seed": seed,
        "seconds": round(seconds, 1),
        "rounds": len(rounds) // len(REGIONS),
        "compression": sorted({r.compression for r in rounds}),
        "transport": args.transport,
        # what a region reads per round: the other region's pseudo-gradient (p2p: what its rank sent, as much)
        "grad_bytes_per_round": round(sum(r.bytes_read if args.transport == "store" else r.bytes_published for r in rounds) / len(rounds)),
        "store_bytes_per_round_max": max(r.store_bytes for r in rounds),
        "train_loss_last10pct": round(sum(losses) / len(losses), 5),
        "eval_loss": round(eval_loss(plan, out / "checkpoints" / REGIONS[0], args.hidden, args.eval_samples, REGIONS), 5),
    }
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per codec: means over seeds, spread, and ratios to fp16 (measured in the same invocation)."""
    out = []
    for name in dict.fromkeys(r["codec"] for r in rows):
        mine = [r for r in rows if r["codec"] == name]
        ev = [r["eval_loss"] for r in mine]
        tr = [r["train_loss_last10pct"] for r in mine]
        out.append(
            {
                "codec": name,
                "seeds": [r["seed"] for r in mine],
                "grad_bytes_per_round": mine[0]["grad_bytes_per_round"],
                "store_bytes_per_round_max": max(r.get("store_bytes_per_round_max", 0) for r in mine),
                "eval_loss_mean": round(sum(ev) / len(ev), 5),
                "eval_loss_spread": round(max(ev) - min(ev), 5),
                "train_loss_mean": round(sum(tr) / len(tr), 5),
            }
        )
    base = next((s for s in out if s["codec"] == "fp16"), None)
    if base:
        for s in out:
            s["bytes_vs_fp16"] = round(s["grad_bytes_per_round"] / base["grad_bytes_per_round"], 4)
            s["eval_loss_vs_fp16"] = round(s["eval_loss_mean"] / base["eval_loss_mean"] - 1, 5)
            s["train_loss_vs_fp16"] = round(s["train_loss_mean"] / base["train_loss_mean"] - 1, 5)
    return out


def speed(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    """Encode + decode seconds per codec at each size (best of ``repeat``), error feedback included
    (what a leader runs per round), and the ratio to fp16's cast measured in the same loop."""
    import torch

    from geoshard.trainer.diloco.codec import CODECS as FORMS
    from geoshard.trainer.diloco.codec import ErrorFeedback

    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        best: dict[str, float] = {}
        for name, c in FORMS.items():
            ef = ErrorFeedback(c, n)
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                c.decode(ef.encode(x), n)
                times.append(time.perf_counter() - t0)
            best[name] = min(times)
        for name, t in best.items():
            rows.append({"numel": n, "codec": name, "seconds": round(t, 4), "vs_fp16": round(t / best["fp16"], 2)})
            print(f"{n:>11,} values  {name:5s}  encode+decode with error feedback {t:.3f} s ({t / best['fp16']:.2f}x fp16's)", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=ROOT / "bench" / "_data")
    p.add_argument("--samples", type=int, default=40000)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--outer-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--transport", choices=("p2p", "store"), default="p2p", help="how the pseudo-gradients travel (--outer-transport)")
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--keep", action="store_true", help="keep the run folders (under --data)")
    p.add_argument("--small", action="store_true", help="smoke run: 40 steps, H=10, one seed")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "codec_bench.json")
    p.add_argument("--speed", action="store_true", help="only time encode + decode at 1M, 16M and 64M values (no training)")
    args = p.parse_args()
    if args.speed:
        rows = speed([1 << 20, 1 << 24, 1 << 26], 3)
        out = args.json_out.with_name("codec_speed.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"load": os.getloadavg(), "rows": rows}, indent=1))
        return 0
    if args.small:
        args.steps, args.outer_steps, args.samples, args.eval_samples, args.seeds = 40, 10, 4000, 200, "0"
    if args.steps % args.outer_steps:
        p.error("--steps must be a multiple of --outer-steps (the final model is then the outer one)")
    names = args.codecs.split(",")
    if unknown := [n for n in names if n not in CODECS]:
        p.error(f"--codecs: unknown {', '.join(unknown)} (choose from {', '.join(CODECS)})")
    args.data.mkdir(parents=True, exist_ok=True)
    split = make_split(args.data, args.samples, SAMPLE_BYTES, REGIONS)
    work = Path(tempfile.mkdtemp(prefix="codec-runs-", dir=args.data))
    plan = local_plan(split, work / "plan.toml", REGIONS)
    result: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": []}
    result["load_before"] = os.getloadavg()
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in names:
                row = one_run(name, seed, plan, work, args)
                row["load"] = round(os.getloadavg()[0], 1)
                result["runs"].append(row)
                result["codecs"] = summarize(result["runs"])
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                args.json_out.write_text(json.dumps(result, indent=1))  # after every run: a cut-short run keeps its rows
                print(
                    f"{name:10s} seed {seed} ({args.transport}): {row['grad_bytes_per_round']:>9,} B/round, "
                    f"eval loss {row['eval_loss']:.4f}, "
                    f"train loss (last 10%) {row['train_loss_last10pct']:.4f}, {row['seconds']:.0f} s, load {row['load']}",
                    flush=True,
                )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    result["codecs"] = summarize(result["runs"])
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["codecs"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
