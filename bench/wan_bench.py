"""Benchmark of the WAN rehearsal (geoshard/wan, docs/wan.md). Needs root.

``accuracy``: how faithfully the forwarder plays a matrix, and its own ceiling. Two regions, one
rehearsal whose matrix changes between measurements (``Rehearsal.set_matrix``):

- the forwarder's ceiling (no delay, no cap: UDP blasts of 1-byte and MTU-sized payloads), measured
  ``--repeat`` times on fresh rehearsals;
- TCP echo round trips (64 bytes, Nagle off, ``--rounds`` each) at one-way latencies of 5, 20, 38,
  85 and 110 ms, against twice the latency;
- one TCP stream's goodput under caps of 10, 40, 100, 200 and 400 Mbit/s at 5 ms one way, counted
  from 1 s after the start for ``--seconds``, against the cap; and with no cap (the forwarder's
  ceiling for one TCP stream, payload and Python end points included).

Both ends of each measurement are sockets of this process made inside the namespaces
(geoshard/wan/measure.py). The median of the rounds is reported; JSON goes to ``--json-out``.

    sudo .venv/bin/python bench/wan_bench.py accuracy            # ~45 s
    sudo .venv/bin/python bench/wan_bench.py accuracy --small    # ~15 s

``train``: the multi-region benchmark of bench/multiregion_bench.py (the same split, ranks
``us-east-1:2,eu-west-1:1,ap-southeast-1:1``, gloo), with every packet between regions behind
``--matrix`` (bench/wan-matrix.toml: 38, 110 and 85 ms one way, 200/100/100 Mbit/s). One SeaweedFS
on the host holds the three buckets; ``Rehearsal.expose`` serves each at its region's address, so
a region reads its own bucket without crossing a link and another region's through the forwarder.
Ranks are launched with ``geoshard.trainer.launch.launch_regions`` inside the namespaces (what
``geoshard train --regions ... --wan`` does). Runs, each ``--steps`` optimizer steps:

- flat and hierarchical sync, each with ``--accum-steps`` 1, 2 and 4;
- fp16 gradient exchange, flat and hierarchical, accumulation 1;
- hierarchical, accumulation 1, each region reading another region's bucket (``remote``).

Reported per run: gradient-sync share of the loop's wall time (and seconds per optimizer step,
the leaders' cross-region hop apart), bytes the forwarder moved between regions per optimizer
step (everything: gradients, data, rendezvous), the trainer's own count of cross-region gradient
bytes, IO wait per region after the first batch, and the forwarder's ceiling.

    sudo .venv/bin/python bench/wan_bench.py train            # ~10-15 minutes on 2 busy cores
    sudo .venv/bin/python bench/wan_bench.py train --small    # smoke run, figures meaningless
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from geoshard.wan import Rehearsal, load_matrix, netns, parse_matrix
from geoshard.wan.measure import rtt, throughput

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS launcher the test suite uses
sys.path.insert(0, str(ROOT / "bench"))
A, B = "us-east-1", "eu-west-1"


def _matrix(latency_ms: float, bandwidth_mbit: float | None = None) -> Any:
    cap = "" if bandwidth_mbit is None else f"bandwidth_mbit = {bandwidth_mbit}\n"
    return parse_matrix(f'[[link]]\na = "{A}"\nb = "{B}"\nlatency_ms = {latency_ms}\n{cap}', source="bench")


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    ceilings = []
    for _ in range(args.repeat):
        with Rehearsal(_matrix(0.0)) as wan:
            ceilings.append(wan.ceiling)
    out: dict[str, Any] = {
        "ceiling": {
            "runs": [{"packets_per_s": round(c.packets_per_s), "mb_per_s": round(c.mb_per_s, 1)} for c in ceilings],
            "packets_per_s": round(statistics.median(c.packets_per_s for c in ceilings)),
            "mb_per_s": round(statistics.median(c.mb_per_s for c in ceilings), 1),
        },
        "rtt": [],
        "throughput": [],
    }
    latencies = (5.0, 38.0) if args.small else (5.0, 20.0, 38.0, 85.0, 110.0)
    caps: tuple[float | None, ...] = (40.0, None) if args.small else (10.0, 40.0, 100.0, 200.0, 400.0, None)
    with Rehearsal(_matrix(latencies[0]), measure_ceiling=False) as wan:
        for latency in latencies:
            wan.set_matrix(_matrix(latency))
            got = [s * 1000 for s in rtt(wan, A, B, args.rounds)]
            med = statistics.median(got)
            out["rtt"].append(
                {
                    "one_way_ms": latency,
                    "expected_ms": 2 * latency,
                    "median_ms": round(med, 2),
                    "min_ms": round(min(got), 2),
                    "max_ms": round(max(got), 2),
                    "error": round(med / (2 * latency) - 1, 4),
                }
            )
            print(f"RTT {2 * latency:6.1f} ms expected, median {med:7.2f} ms ({med / (2 * latency) - 1:+.1%})", flush=True)
        late = wan.lateness()
        out["lateness_ms"] = {"packets": late.packets, "mean": round(late.mean_ms, 3), "max": round(late.max_ms, 3)}
        for cap in caps:
            wan.set_matrix(_matrix(5.0, cap))
            before = wan.dropped()[(A, B)]
            mbit = throughput(wan, A, B, args.seconds, warmup=1.0) * 8 / 1e6
            dropped = wan.dropped()[(A, B)] - before
            row = {"cap_mbit": cap, "goodput_mbit": round(mbit, 2), "dropped_packets": dropped}
            if cap is not None:
                row["error"] = round(mbit / cap - 1, 4)
            out["throughput"].append(row)
            print(f"cap {cap or 'none':>5} Mbit/s: goodput {mbit:8.1f} Mbit/s, {dropped} packets dropped", flush=True)
    return out


def markdown(res: dict[str, Any]) -> str:
    c = res["ceiling"]
    lines = [
        f"Forwarder ceiling (median of {len(c['runs'])}): {c['packets_per_s']:,} packets/s (1-byte UDP), "
        f"{c['mb_per_s']:,.0f} MB/s (MTU-sized UDP)",
        "",
        "| one way | RTT expected | RTT median | min | max | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rtt"]:
        lines.append(
            f"| {r['one_way_ms']:g} ms | {r['expected_ms']:g} ms | {r['median_ms']:.2f} ms | {r['min_ms']:.2f} ms"
            f" | {r['max_ms']:.2f} ms | {r['error']:+.1%} |"
        )
    late = res["lateness_ms"]
    lines += ["", f"Delayed packets left {late['mean']:.2f} ms late on average (max {late['max']:.1f} ms, {late['packets']:,} packets)."]
    lines.append("")
    lines += ["| cap | TCP goodput | error | packets dropped |", "|---|---|---|---|"]
    for r in res["throughput"]:
        cap = "none" if r["cap_mbit"] is None else f"{r['cap_mbit']:g} Mbit/s"
        err = "" if r["cap_mbit"] is None else f"{r['error']:+.1%}"
        lines.append(f"| {cap} | {r['goodput_mbit']:.1f} Mbit/s | {err} | {r['dropped_packets']} |")
    return "\n".join(lines)


# -- train -------------------------------------------------------------------------------------


def _runs(small: bool) -> list[dict[str, Any]]:
    runs = []
    for sync_mode in ("flat", "hierarchical"):
        for accum in (1, 4) if small else (1, 2, 4):
            runs.append({"data": "local", "sync": sync_mode, "accum": accum, "fp16": False})
    if not small:
        runs += [{"data": "local", "sync": m, "accum": 1, "fp16": True} for m in ("flat", "hierarchical")]
    runs.append({"data": "remote", "sync": "hierarchical", "accum": 1, "fp16": False})
    return runs


def _region_net(wan: Rehearsal) -> Any:
    from geoshard.trainer.launch import RegionNet

    kw: dict[str, Any] = {"address": wan.address, "wrap": wan.exec_argv, "env": wan.env}
    if "inside" in {f.name for f in fields(RegionNet)}:  # where the launcher's rendezvous store listens
        kw["inside"] = lambda region: netns.inside(wan.netns(region))
    return RegionNet(**kw)


def _one_run(spec: dict[str, Any], wan: Rehearsal, endpoints: dict[str, str], env: dict[str, str], work: Path, args: Any) -> dict:
    from multiregion_bench import READS_FROM, WEIGHTS, bucket_plan

    from geoshard.trainer.config import TrainConfig, parse_regions
    from geoshard.trainer.launch import launch_regions
    from geoshard.trainer.report import build_report

    name = f"{spec['data']}-{spec['sync']}-accum{spec['accum']}" + ("-fp16" if spec["fp16"] else "")
    reads = {r: READS_FROM[r] if spec["data"] == "remote" else r for r in WEIGHTS}
    plan = bucket_plan(work / f"plan-{spec['data']}.toml", {r: endpoints[reads[r]] for r in WEIGHTS})
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(
        plan=plan,
        out=out,
        steps=args.steps,
        batch_size=args.batch_size,
        accum_steps=spec["accum"],
        hidden=args.hidden,
        num_workers=args.num_workers,
        grad_compression="fp16" if spec["fp16"] else "none",
        sync=spec["sync"],
        backend="gloo",
        checkpoint_every=args.steps,
        allow_cross_region=False,
    )
    before = wan.counters()
    t0 = time.monotonic()
    code = launch_regions(cfg, parse_regions(RANKS), env=env, net=_region_net(wan))
    seconds = time.monotonic() - t0
    crossed = {k: v[0] - before[k][0] for k, v in wan.counters().items()}
    if code != 0:
        raise RuntimeError(f"run {name} failed ({code}); logs in {out}/logs")
    rep = build_report(out, cfg.budget)
    steps = rep["steps"]
    loop_wall = rep["breakdown"]["wall"]["seconds"] / rep["world_size"]  # per rank
    sync_s = rep["grad_sync_s_per_step"]
    row = {
        **spec,
        "name": name,
        "seconds": round(seconds, 1),
        "steps": steps,
        "step_s": round(loop_wall / steps, 4),
        "grad_sync_s_per_step": sync_s,
        "grad_sync_cross_s_per_step": rep["grad_sync_cross_s_per_step"],
        "grad_sync_share": round(sync_s * steps / loop_wall, 4) if loop_wall else None,
        "forwarder_bytes_per_step": round(sum(crossed.values()) / steps),
        "forwarder_bytes_by_pair": {f"{a}>{b}": n for (a, b), n in crossed.items()},
        "trainer_cross_region_grad_bytes_per_step": rep["cross_region_grad_bytes_per_step"],
        "cross_region_data_bytes": rep["cross_region_data_bytes"],
        "io_wait_after_first_batch": {r: g["io_wait_share_after_first_batch"] for r, g in rep["regions"].items()},
        "time_to_first_batch_s": {r: g["time_to_first_batch_s"] for r, g in rep["regions"].items()},
        "loss_first": rep["loss_first"],
        "loss_last": rep["loss_last"],
    }
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return row


RANKS = "us-east-1:2,eu-west-1:1,ap-southeast-1:1"


def train(args: argparse.Namespace) -> dict[str, Any]:
    from multiregion_bench import WEIGHTS, make_split, sync
    from servers import SeaweedS3

    matrix = load_matrix(args.matrix)
    args.data.mkdir(parents=True, exist_ok=True)
    split = make_split(args.data, args.samples, args.sample_bytes, args.shard_samples)
    work = Path(tempfile.mkdtemp(prefix="wan-runs-", dir=args.data))
    out: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": []}
    out["config"]["ranks"] = RANKS
    out["config"]["matrix"] = [vars(link) for link in matrix.links]
    try:
        with SeaweedS3(work / "weed") as server:
            env = server.env(endpoint=False)
            sync(split, server, {**os.environ, **env}, work)
            with Rehearsal(matrix, regions=tuple(WEIGHTS)) as wan:
                out["ceiling"] = {"packets_per_s": round(wan.ceiling.packets_per_s), "mb_per_s": round(wan.ceiling.mb_per_s, 1)}
                print(wan.ceiling, flush=True)
                endpoints = {r: "http://{}:{}".format(*wan.expose(r, server.port)) for r in WEIGHTS}
                for spec in _runs(args.small):
                    print(f"run: {spec} ...", flush=True)
                    row = _one_run(spec, wan, endpoints, env, work, args)
                    out["runs"].append(row)
                    print(
                        f"  sync {row['grad_sync_share']:.1%} of wall, {row['grad_sync_s_per_step'] * 1000:.0f} ms/step, "
                        f"{row['forwarder_bytes_per_step'] / 1e6:.2f} MB/step across regions",
                        flush=True,
                    )
                late = wan.lateness()
                out["lateness_ms"] = {"packets": late.packets, "mean": round(late.mean_ms, 3), "max": round(late.max_ms, 3)}
                out["dropped"] = {f"{a}>{b}": n for (a, b), n in wan.dropped().items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def train_markdown(res: dict[str, Any]) -> str:
    c = res["ceiling"]
    lines = [
        f"Forwarder ceiling at start: {c['packets_per_s']:,} packets/s, {c['mb_per_s']:,.0f} MB/s; "
        f"delayed packets {res['lateness_ms']['mean']:.2f} ms late on average (max {res['lateness_ms']['max']:.1f} ms)",
        "",
        "| data | sync | accum | fp16 | step | grad sync / step | cross hop | sync share | MB/step across (forwarder)"
        " | MB/step (trainer's count) | IO wait after 1st batch (max region) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        io = max(r["io_wait_after_first_batch"].values())
        lines.append(
            f"| {r['data']} | {r['sync']} | {r['accum']} | {'yes' if r['fp16'] else 'no'} | {r['step_s'] * 1000:.0f} ms"
            f" | {r['grad_sync_s_per_step'] * 1000:.0f} ms | {r['grad_sync_cross_s_per_step'] * 1000:.0f} ms"
            f" | {r['grad_sync_share']:.1%} | {r['forwarder_bytes_per_step'] / 1e6:.2f}"
            f" | {r['trainer_cross_region_grad_bytes_per_step'] / 1e6:.2f} | {io:.2%} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    acc = sub.add_parser("accuracy", help="forwarder ceiling, RTT and throughput accuracy")
    acc.add_argument("--small", action="store_true", help="fewer points (smoke run)")
    acc.add_argument("--repeat", type=int, default=3, help="ceiling measurements")
    acc.add_argument("--rounds", type=int, default=20, help="echo round trips per latency")
    acc.add_argument("--seconds", type=float, default=3.0, help="counted seconds per throughput point")
    acc.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "wan_accuracy.json")
    tr = sub.add_parser("train", help="multi-region training under the matrix: flat vs hierarchical, accumulation, fp16")
    tr.add_argument("--matrix", type=Path, default=ROOT / "bench" / "wan-matrix.toml")
    tr.add_argument("--data", type=Path, default=ROOT / "bench" / "_data" / "multiregion")
    tr.add_argument("--samples", type=int, default=24_000)
    tr.add_argument("--sample-bytes", type=int, default=1000)
    tr.add_argument("--shard-samples", type=int, default=1000)
    tr.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    tr.add_argument("--batch-size", type=int, default=64)
    tr.add_argument("--num-workers", type=int, default=1)
    tr.add_argument("--hidden", type=int, default=1024, help="model width: 1024 is 1.3 M parameters, 5.3 MB of fp32 gradients")
    tr.add_argument("--small", action="store_true", help="smoke run (figures meaningless)")
    tr.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "wan_train.json")
    args = ap.parse_args()
    if args.what == "train" and args.small:
        args.samples, args.steps, args.hidden = 6000, 4, 128
    t0 = time.monotonic()
    res = accuracy(args) if args.what == "accuracy" else train(args)
    res["seconds"] = round(time.monotonic() - t0, 1)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(res, indent=1))
    print(markdown(res) if args.what == "accuracy" else train_markdown(res))
    print(f"JSON: {args.json_out} ({res['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
