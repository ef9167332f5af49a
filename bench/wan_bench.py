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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from geoshard.wan import Rehearsal, parse_matrix
from geoshard.wan.measure import rtt, throughput

ROOT = Path(__file__).resolve().parents[1]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    acc = sub.add_parser("accuracy", help="forwarder ceiling, RTT and throughput accuracy")
    acc.add_argument("--small", action="store_true", help="fewer points (smoke run)")
    acc.add_argument("--repeat", type=int, default=3, help="ceiling measurements")
    acc.add_argument("--rounds", type=int, default=20, help="echo round trips per latency")
    acc.add_argument("--seconds", type=float, default=3.0, help="counted seconds per throughput point")
    acc.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "wan_accuracy.json")
    args = ap.parse_args()
    t0 = time.monotonic()
    res = accuracy(args)
    res["seconds"] = round(time.monotonic() - t0, 1)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(res, indent=1))
    print(markdown(res))
    print(f"JSON: {args.json_out} ({res['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
