"""DiLoCo against flat DDP at equal samples, over several seeds (issue 23, part 9).

Three regions, one rank each (``us-east-1:1,eu-west-1:1,ap-southeast-1:1``, gloo), on 127.0.0.1:
the loss after a number of samples does not depend on the links' latency, so no rehearsal (and
no root) is needed. Every run trains ``--steps`` optimizer steps at ``--batch-size`` per rank, so
every run has seen the same samples. Per inner optimizer (``--inner-optimizers``: sgd at
``--lr``, adamw at ``--adamw-lr`` with the paper's betas and weight decay) and per seed
(``--seeds``: the model's initial weights and the loaders' order), one flat DDP run and one
DiLoCo run at H = ``--outer-steps`` (the paper's outer settings: lr 0.7, Nesterov momentum 0.9).

Figure: the eval loss of the final model (DiLoCo: the outer parameters after the last round;
``--steps`` is a multiple of H) on the first ``--eval-samples`` samples of each region. Per seed
the ratio DiLoCo / flat; over the seeds its mean and a 95% Student-t interval. The claim
"DiLoCo within 2% of DDP at equal samples" **holds** when the whole interval lies at or below
+2%, is **refuted** when the whole interval lies above it, and is **undecided** otherwise.

    .venv/bin/python bench/diloco_loss_bench.py                            # 3 seeds, sgd and adamw
    .venv/bin/python bench/diloco_loss_bench.py --seeds 0 --inner-optimizers sgd --steps 50 --outer-steps 25  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from diloco_bench import RANKS, eval_loss, local_plan, make_split  # noqa: E402

# Two-sided 95% Student-t critical values by degrees of freedom (n - 1 seeds).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
CLAIM = 0.02


def one_run(sync: str, optimizer: str, seed: int, plan: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from geoshard.trainer.config import TrainConfig, parse_regions
    from geoshard.trainer.launch import launch_regions
    from geoshard.trainer.report import build_report

    name = f"{sync}-{optimizer}-seed{seed}"
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(
        plan=plan,
        out=out,
        steps=args.steps,
        batch_size=args.batch_size,
        hidden=args.hidden,
        lr=args.adamw_lr if optimizer == "adamw" else args.lr,
        inner_optimizer=optimizer,
        seed=seed,
        num_workers=1,
        sync=sync,
        outer_steps=args.outer_steps,
        outer_timeout=600.0,
        backend="gloo",
        checkpoint_every=args.steps,
        allow_cross_region=False,
    )
    t0 = time.monotonic()
    code = launch_regions(cfg, parse_regions(RANKS))
    if code != 0:
        raise RuntimeError(f"run {name} failed ({code}); logs in {out}/logs")
    rep = build_report(out, cfg.budget)
    ckpt = out / "checkpoints" / ("us-east-1" if sync == "diloco" else "")
    row = {
        "name": name,
        "sync": sync,
        "inner_optimizer": optimizer,
        "seed": seed,
        "seconds": round(time.monotonic() - t0, 1),
        "samples": rep["samples"],
        "eval_loss": round(eval_loss(plan, ckpt, args.hidden, args.eval_samples), 5),
        "loss_last": rep["loss_last"],
    }
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def verdict(ratios: list[float]) -> dict[str, Any]:
    """Mean of DiLoCo / flat - 1 over the seeds, its 95% interval, and what it says of the 2% claim."""
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return {"mean": round(mean, 5), "interval": None, "claim": "undecided (one seed: no spread)"}
    half = T95.get(len(ratios) - 1, 1.96) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    low, high = mean - half, mean + half
    claim = "holds" if high <= CLAIM else "refuted" if low > CLAIM else "undecided"
    return {"mean": round(mean, 5), "sd": round(statistics.stdev(ratios), 5), "interval": [round(low, 5), round(high, 5)], "claim": claim}


def summary(rows: list[dict[str, Any]], optimizer: str) -> dict[str, Any]:
    def losses(sync: str) -> dict[int, float]:
        return {r["seed"]: r["eval_loss"] for r in rows if r["sync"] == sync and r["inner_optimizer"] == optimizer}

    flat, diloco = losses("flat"), losses("diloco")
    seeds = sorted(flat.keys() & diloco.keys())
    out: dict[str, Any] = {"inner_optimizer": optimizer, "seeds": seeds}
    for sync, table in (("flat", flat), ("diloco", diloco)):
        vals = [table[s] for s in seeds]
        out[sync] = {"mean": round(statistics.fmean(vals), 5), "min": min(vals), "max": max(vals)}
        out[sync]["sd"] = round(statistics.stdev(vals), 5) if len(vals) > 1 else None
    out["diloco_vs_flat"] = verdict([diloco[s] / flat[s] - 1 for s in seeds])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=ROOT / "bench" / "_data")
    p.add_argument("--samples", type=int, default=60000)
    p.add_argument("--sample-bytes", type=int, default=300)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05, help="sgd's learning rate (flat and inner)")
    p.add_argument("--adamw-lr", type=float, default=1e-3, help="adamw's learning rate (flat and inner; the paper: 4e-4)")
    p.add_argument("--outer-steps", type=int, default=50)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--inner-optimizers", default="sgd,adamw")
    p.add_argument("--eval-samples", type=int, default=1000)
    p.add_argument("--keep", action="store_true", help="keep the run folders (under --data)")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "diloco_loss_bench.json")
    args = p.parse_args()
    if args.steps % args.outer_steps:
        p.error("--steps must be a multiple of --outer-steps (the final model is then the outer one)")
    seeds = [int(s) for s in args.seeds.split(",")]
    optimizers = args.inner_optimizers.split(",")
    args.data.mkdir(parents=True, exist_ok=True)
    split = make_split(args.data, args.samples, args.sample_bytes)
    work = Path(tempfile.mkdtemp(prefix="diloco-loss-", dir=args.data))
    plan = local_plan(split, work / "plan.toml")
    result: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": []}
    try:
        for optimizer in optimizers:
            for seed in seeds:
                for sync in ("flat", "diloco"):
                    row = one_run(sync, optimizer, seed, plan, work, args)
                    result["runs"].append(row)
                    print(f"{row['name']}: eval loss {row['eval_loss']:.4f} ({row['seconds']:.0f} s)", flush=True)
                    args.json_out.write_text(json.dumps(result, indent=1))  # a partial result survives an interruption
            result.setdefault("summary", []).append(summary(result["runs"], optimizer))
            print(json.dumps(result["summary"][-1]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    args.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
