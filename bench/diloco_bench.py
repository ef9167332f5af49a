"""DiLoCo against synchronous DDP across three regions under the WAN rehearsal (issue 11). Needs root.

Three regions, one rank each (``us-east-1:1,eu-west-1:1,ap-southeast-1:1``, gloo), every packet
between regions behind ``--matrix`` (bench/wan-matrix.toml: 38, 110 and 85 ms one way,
200/100/100 Mbit/s), each region reading its own local replica. The built-in MLP at ``--hidden
1536`` has 2.76 M parameters: 11 MB of fp32 gradients (the issue asks for at least 8 MB). Every
run trains the same ``--steps`` optimizer steps at the same global batch (3 x ``--batch-size``),
so every run has seen the same number of samples:

- ``flat``: DDP, one ring all-reduce over the three regions every step;
- ``hierarchical``: DDP, the regions' leaders all-reduce (one rank per region: the same ring, the
  in-region hops are empty);
- ``diloco-H`` for each H in ``--outer-steps`` (10, 50, 100): each region trains alone, every H
  steps the regions average fp16 pseudo-gradients through the launcher's store (in us-east-1's
  namespace, so eu-west-1's and ap-southeast-1's cross the links); training waits for each round;
- ``diloco-H-overlapK`` for each K in ``--overlap`` other than 0 (default 25, at most H-1): the
  same, with each round's exchange running behind K inner steps (``--outer-overlap``).

``--step-time`` adds stated compute per step (default 0.2 s, a step of a model larger than the
MLP on an accelerator): the MLP's own ~30-60 ms on two shared CPU cores would make every
exchange look expensive. Reported per run: compute utilization (compute without gradient
exchange over wall; the report's figure), seconds per step, the bytes the forwarder moved
between regions, and the loss after the same samples: the mean training loss of the last 10% of
steps, and the eval loss of the final model (DiLoCo: the outer parameters after the last round;
``--steps`` is a multiple of every H) on the first ``--eval-samples`` samples of each region.

    sudo .venv/bin/python bench/diloco_bench.py                 # ~20 minutes on 2 busy cores
    sudo .venv/bin/python bench/diloco_bench.py --small         # smoke run, figures meaningless
    sudo .venv/bin/python bench/diloco_bench.py --runs diloco --outer-steps 100 --overlap 25 --steps 2000  # steady state
    ... --extra-train-args '--outer-transport p2p'              # every run with more trainer options

Each run also reports its start-up (until every region took its first step) and the utilization
of its steady state (after it, without each region's first outer round until applied and its last
round: ``utilization_steady`` in the report, trainer/steady.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

REGIONS = ("us-east-1", "eu-west-1", "ap-southeast-1")
RANKS = ",".join(f"{r}:1" for r in REGIONS)


def local_plan(split: Path, path: Path, regions: tuple[str, ...] = REGIONS) -> Path:
    path.write_text("".join(f'[regions.{r}]\nweight = 1\nlocal = "{split / r}"\n' for r in regions))
    return path


def make_split(data: Path, samples: int, sample_bytes: int, regions: tuple[str, ...] = REGIONS) -> Path:
    """A split of ``samples`` synthetic samples over ``regions``, kept in ``data`` between runs."""
    import subprocess

    geoshard = str(Path(sys.executable).with_name("geoshard"))
    root = data / (f"diloco-{samples}x{sample_bytes}" + ("" if regions == REGIONS else "-" + "-".join(regions)))
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        args = ["--samples", str(samples), "--sample-bytes", str(sample_bytes), "--shard-samples", "1000"]
        subprocess.run([geoshard, "synth", str(root / "corpus"), *args], check=True, capture_output=True, timeout=1800)
        plan = root / "plan.toml"
        plan.write_text('[shards]\nbytes = "4MB"\n' + "".join(f"[regions.{r}]\nweight = 1\n" for r in regions))
        sources = [str(p) for p in sorted((root / "corpus").glob("*.tar"))]
        cmd = [geoshard, "split", *sources, "--plan", str(plan), "--out", str(root / "split"), "--json"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
        shutil.rmtree(root / "corpus")
        (root / ".complete").touch()
    return root / "split"


def eval_loss(plan: Path, checkpoint: Path, hidden: int, samples: int, regions: tuple[str, ...] = REGIONS) -> float:
    """Cross-entropy of the final model on the first ``samples`` samples of each region (fixed)."""
    import torch
    import torch.nn.functional as F

    from geoshard.loaders import RegionalDataset
    from geoshard.trainer.checkpoint import CheckpointStore
    from geoshard.trainer.model import Net, collate, to_tensors

    latest = CheckpointStore(str(checkpoint)).load_latest()
    assert latest is not None, checkpoint
    model = Net(hidden)
    model.load_state_dict(latest[1]["model"])
    total, n = 0.0, 0
    with torch.no_grad():
        for region in regions:
            ds = RegionalDataset(plan, region=region, shuffle=False, region_rank=0, region_size=1)
            batch: list[Any] = []
            for sample in ds:
                batch.append(sample)
                if len(batch) == samples:
                    break
            x, y = to_tensors(collate(batch), torch.device("cpu"))
            total += float(F.cross_entropy(model(x), y, reduction="sum"))
            n += len(y)
    return total / n


def one_run(
    name: str, sync: str, outer_steps: int, overlap: int, wan: Any, net: Any, plan: Path, work: Path, args: argparse.Namespace
) -> dict:
    from geoshard.trainer.config import TrainConfig, parse_regions
    from geoshard.trainer.launch import launch_regions
    from geoshard.trainer.record import read_steps
    from geoshard.trainer.report import build_report

    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(
        plan=plan,
        out=out,
        steps=args.steps,
        batch_size=args.batch_size,
        hidden=args.hidden,
        lr=args.lr,
        num_workers=1,
        sync=sync,
        outer_steps=outer_steps,
        outer_overlap=overlap,
        outer_timeout=300.0,
        step_time=args.step_time,
        backend="gloo",
        checkpoint_every=args.steps,
        allow_cross_region=False,
    )
    cfg = with_extra_args(cfg, args.extra_train_args)
    before = wan.counters()
    t0 = time.monotonic()
    code = launch_regions(cfg, parse_regions(RANKS), net=net)
    seconds = time.monotonic() - t0
    crossed = sum(v[0] - before[k][0] for k, v in wan.counters().items())
    if code != 0:
        raise RuntimeError(f"run {name} failed ({code}); logs in {out}/logs")
    rep = build_report(out, cfg.budget)
    losses = []
    for rank in range(len(REGIONS)):
        recs = read_steps(out / f"steps-rank{rank}.jsonl", rank)
        tail = recs[-max(1, len(recs) // 10) :]
        losses += [r.loss for r in tail]
    ckpt = out / "checkpoints" / (REGIONS[0] if sync == "diloco" else "")
    row = {
        "name": name,
        "sync": sync,
        "outer_steps": outer_steps if sync == "diloco" else None,
        "outer_overlap": overlap if sync == "diloco" else None,
        "seconds": round(seconds, 1),
        "steps": rep["steps"],
        "samples": rep["samples"],
        "step_s": round(rep["breakdown"]["wall"]["seconds"] / rep["world_size"] / rep["steps"], 4),
        "utilization": rep["utilization"]["share"],
        # Start-up apart: until every region took its first step; the steady state after it, without
        # the first and last outer rounds' edges (trainer/steady.py).
        "startup_s": rep["startup_s"],
        "utilization_steady": (rep["utilization_steady"] or {}).get("share"),
        "steady_steps": [(rep["utilization_steady"] or {}).get(k) for k in ("step_from", "step_to")],
        "breakdown_shares": {k: v["share"] for k, v in rep["breakdown"].items()},
        "grad_sync_s_per_step": rep["grad_sync_s_per_step"],
        "outer_sync_share": rep["breakdown"]["outer_sync"]["share"],
        "outer_rounds": (rep["outer"] or {}).get("round_count"),
        "outer_sync_s_mean": (rep["outer"] or {}).get("sync_s_mean"),
        "forwarder_bytes": crossed,
        "forwarder_bytes_per_step": round(crossed / rep["steps"]),
        "train_loss_last10pct": round(sum(losses) / len(losses), 5),
        "eval_loss": round(eval_loss(plan, ckpt, args.hidden, args.eval_samples), 5),
        "loss_first": rep["loss_first"],
        # Each region's sync time per round (seconds): the slowest is what the job waits for.
        "round_sync_s": _round_syncs(out),
    }
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return row


def with_extra_args(cfg: Any, extra: str) -> Any:
    """The run's config with ``--extra-train-args`` applied as ``python -m geoshard.trainer`` would
    read them (e.g. ``--outer-transport p2p`` once that exists): the last value of an option wins."""
    import shlex

    from geoshard.trainer.__main__ import main as trainer_cli
    from geoshard.trainer.options import config_from

    if not extra.strip():
        return cfg
    ctx = trainer_cli.make_context("geoshard.trainer", [*cfg.to_argv(), *shlex.split(extra)])
    return config_from(**ctx.params)


def _round_syncs(out: Path) -> dict[str, dict[str, float]]:
    from geoshard.trainer.diloco.record import read_rounds

    table: dict[str, dict[str, float]] = {}
    for rec in read_rounds(out):
        if rec.event == "round":
            table.setdefault(str(rec.round), {})[rec.region] = round(rec.sync_s, 3)
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--matrix", type=Path, default=ROOT / "bench" / "wan-matrix.toml")
    p.add_argument("--data", type=Path, default=ROOT / "bench" / "_data")
    p.add_argument("--samples", type=int, default=60000)
    p.add_argument("--sample-bytes", type=int, default=300)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--outer-steps", default="10,50,100")
    p.add_argument(
        "--overlap",
        default="0,25",
        help="DiLoCo runs with each of these --outer-overlap values (inner steps the exchange runs behind; at most H-1)",
    )
    p.add_argument("--eval-samples", type=int, default=1000)
    p.add_argument("--runs", default="flat,hierarchical,diloco")
    p.add_argument("--keep", action="store_true", help="keep the run folders (under --data)")
    p.add_argument(
        "--extra-train-args",
        default="",
        help="more trainer options for every run, as one string (e.g. '--outer-transport p2p'); applied last",
    )
    p.add_argument("--small", action="store_true", help="smoke run: 20 steps, H=10, hidden 256")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "diloco_bench.json")
    args = p.parse_args()
    if args.small:
        args.steps, args.hidden, args.outer_steps, args.samples, args.eval_samples = 20, 256, "10", 6000, 200
    hs = [int(h) for h in args.outer_steps.split(",")]
    if any(args.steps % h for h in hs):
        p.error("--steps must be a multiple of every --outer-steps (the final model is then the outer one)")

    from geoshard.trainer.launch import RegionNet
    from geoshard.wan import Rehearsal, load_matrix, netns

    matrix = load_matrix(args.matrix)
    args.data.mkdir(parents=True, exist_ok=True)
    split = make_split(args.data, args.samples, args.sample_bytes)
    work = Path(tempfile.mkdtemp(prefix="diloco-runs-", dir=args.data))
    plan = local_plan(split, work / "plan.toml")
    result: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": []}
    try:
        with Rehearsal(matrix, regions=REGIONS) as wan:
            result["ceiling"] = {"packets_per_s": round(wan.ceiling.packets_per_s), "mb_per_s": round(wan.ceiling.mb_per_s, 1)}
            print(wan.ceiling, flush=True)
            net = RegionNet(
                address=wan.address,
                wrap=wan.exec_argv,
                env=lambda r: {**wan.env(r), "TORCH_CPP_LOG_LEVEL": "ERROR"},
                inside=lambda r: netns.inside(wan.netns(r)),
            )
            specs = [(m, m, 1, 0) for m in ("flat", "hierarchical") if m in args.runs.split(",")]
            if "diloco" in args.runs.split(","):
                overlaps = [int(k) for k in args.overlap.split(",")]
                for k in overlaps:  # at most H-1 steps behind
                    specs += [(f"diloco-H{h}" + (f"-overlap{min(k, h - 1)}" if k else ""), "diloco", h, min(k, h - 1)) for h in hs]
            for name, sync, h, k in specs:
                print(f"run {name} ...", flush=True)
                row = one_run(name, sync, h, k, wan, net, plan, work, args)
                result["runs"].append(row)
                steady = row["utilization_steady"]
                print(
                    f"  utilization {row['utilization']:.1%} (steady state {'-' if steady is None else f'{steady:.1%}'}, "
                    f"start-up {row['startup_s']} s), {row['step_s'] * 1000:.0f} ms/step, "
                    f"{row['forwarder_bytes'] / 1e6:.1f} MB across regions, eval loss {row['eval_loss']:.4f} "
                    f"(train, last 10%: {row['train_loss_last10pct']:.4f})",
                    flush=True,
                )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    base = next((r for r in result["runs"] if r["sync"] == "flat"), None)
    if base:
        for r in result["runs"]:
            r["eval_loss_vs_flat"] = round(r["eval_loss"] / base["eval_loss"] - 1, 5)
    args.json_out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["runs"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
