"""The outer exchange's engines under the WAN rehearsal (issue 23, parts 1 and 3). Needs root.

Three regions (us-east-1, eu-west-1, ap-southeast-1) behind ``--matrix`` (bench/wan-matrix.toml:
38 / 110 / 85 ms one way, 200 / 100 / 100 Mbit/s), each process in its region's namespace bound
to its region's address (bench/exchange_worker.py). For fp16 tensors of each ``--sizes`` (MB),
the median of ``--repeats`` exchanges after one warm-up (sizes from ``--once-from`` MB on: one
exchange, no warm-up), each timed from a barrier to the last rank's end, of:

- ``ring``: one plain gloo all-reduce among one process per region (the baseline);
- ``streams-K``: the tensor in K chunks, each all-reduced at once on its own gloo group;
- ``sharded-K`` (``--ppr 2``: two processes per region): process k of every region all-reduces
  half k in K streams, then each region's processes all-gather in the region (no link crossed);
- ``trainer-K`` (``--ppr`` 1 and 2): the trainer's own p2p path (trainer/diloco/sharded.py and
  mac.py): groups reused, K streams per region pair split over the shards, the MAC projections
  published in the store during the transfer and checked after it, then the in-region gather;
  each phase timed; its groups made once per size, first one after another (the baseline, as
  the trainer did before), then all at once (as it does), both timed;
- ``trainer-K.nomac``, ``trainer-K.nostage``, ``trainer-K.prepub`` (switches, combinable: one
  experiment each): ``trainer-K`` without the MAC, without the staged step, or with the MAC
  publish before the transfer instead of during it; every ``trainer-K`` row splits ``transfer``
  into ``wire`` (until the last chunk landed; ``chunk1``: the first) and ``landed`` (the pass on
  what landed: MAC buckets, staged step, gather posting);
- ``trainer-int8-K`` (``--ppr`` 1 and 2; not in the default set): the trainer's int8 path
  (trainer/diloco/quantized.py) on ``trainer-K``'s groups: the same values as fp16's B, encoded
  with error feedback, a reduce-scatter and an all-gather in int8 bytes (about B/2 a round), each
  piece's HMAC digest signed in the store and checked, then the in-region gather; phases timed;
- ``torchft``: torchft 0.2.0 from its own venv (``--torchft-python``): a Lighthouse on us-east-1's
  address, a Manager per region, per round ``start_quorum``, ``allreduce`` (the average) and
  ``should_commit``, each phase timed.

Against the ring's bound for n regions and B bytes: ``2(n-1)/n * B / bw + 2(n-1) * lat``, with bw
the slowest link's bandwidth and lat the longest one-way latency (n = 3 here: 4/3 B over
100 Mbit/s + 4 x 110 ms). ``fill`` is the bound's bandwidth term over the time left after its
latency term: the share of the slowest link the exchange used. Bytes on each directed link per
exchange come from the forwarder's counters around the timed repeats, as a multiple of B. Every
figure carries the 1-minute load average taken when it was measured, and the CPU used over the
timed repeats (bench/cpu_sampler.py): by the forwarder, by each region's ranks, and the machine's
cores (busy share, and the share of the window they were saturated), with the packets the links
dropped.

    sudo .venv/bin/python bench/exchange_bench.py                # ~21 minutes on 2 busy cores
    sudo .venv/bin/python bench/exchange_bench.py --small        # smoke run, ~3 minutes
    sudo .venv/bin/python bench/exchange_bench.py --sizes 22 --variants ring,streams-4
    sudo .venv/bin/python bench/exchange_bench.py --sizes 22,91 --variants ring,trainer-8,trainer-int8-8

``--idle S`` has every rank sleep S seconds before each exchange (warm-up and timed), as a DiLoCo
round follows H inner steps: a TCP connection idle past its retransmission timeout restarts from
its initial window (Linux's ``net.ipv4.tcp_slow_start_after_idle``, 1 by default). ``--mtu 1500``
gives a real path's segments (the default 65,000 makes the initial window 10 x 64 KB, larger than
a stream's share of these links' bandwidth-delay product, which hides the restart), ``--sysctl
net.ipv4.tcp_slow_start_after_idle=0`` the tuned hosts' setting:

    sudo .venv/bin/python bench/exchange_bench.py --sizes 22 --variants ring,trainer-8 --trainer-ppr 1 --mtu 1500 --idle 2
    sudo .venv/bin/python bench/exchange_bench.py --sizes 22 --variants ring,trainer-8 --trainer-ppr 1 --mtu 1500 --idle 2 \\
        --sysctl net.ipv4.tcp_slow_start_after_idle=0

``--transport geoshard`` runs the streams and sharded variants through the hook
``exchange_geoshard`` in bench/exchange_worker.py (the project's exchange, once wired).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from cpu_sampler import CpuSampler  # bench/, the script's own folder

from geoshard.wan import Rehearsal, load_matrix, require_root
from geoshard.wan.rehearsal import MTU

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "exchange_worker.py"
REGIONS = ("us-east-1", "eu-west-1", "ap-southeast-1")
VARIANTS = "ring,streams-2,streams-4,streams-8,sharded-1,sharded-2,sharded-4,torchft"
BOUND = "2(n-1)/n * B / bw_slowest + 2(n-1) * latency_longest"


def bound_s(matrix: Any, regions: tuple[str, ...], nbytes: int) -> dict[str, float]:
    links = [link for link in matrix.links if link.a in regions and link.b in regions]
    bw = min(link.bandwidth_mbit for link in links) * 1e6 / 8  # bytes/s
    lat = max(link.latency_ms for link in links) / 1000
    n = len(regions)
    transfer = 2 * (n - 1) / n * nbytes / bw
    return {"bound_s": transfer + 2 * (n - 1) * lat, "transfer_s": transfer, "latency_s": 2 * (n - 1) * lat}


def _readline(stream: IO[str], timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no line from the workers in {timeout:.0f} s")
    line = stream.readline()
    if not line:
        raise RuntimeError("rank 0 exited")
    return line.strip()


def run_config(wan: Rehearsal, engine: str, ppr: int, plan: list[list[Any]], args: argparse.Namespace, logs: Path) -> list[dict]:
    """Launch n x ppr workers in their namespaces and run ``plan`` ([variant, bytes, warmup, repeats])."""
    python = str(args.torchft_python if engine == "torchft" else Path(sys.executable))
    n = len(REGIONS)
    base = 20000 + os.getpid() % 20000
    common = ["--engine", engine, "--transport", args.transport, "--world", str(n * ppr), "--regions", str(n)]
    common += ["--ppr", str(ppr), "--store-addr", wan.address(REGIONS[0]), "--store-port", str(base)]
    common += ["--lighthouse-port", str(base + 1), "--group-store-port", str(base + 2), "--manager-port", str(base + 3)]
    common += ["--plan", json.dumps(plan), "--timeout", str(args.timeout), "--idle", str(args.idle)]
    common += [] if args.groups_baseline else ["--no-groups-baseline"]
    procs: list[subprocess.Popen] = []
    rows: list[dict] = []
    try:
        for rank in range(n * ppr):
            region = REGIONS[rank % n]
            argv = [python, str(WORKER), "--rank", str(rank), "--address", wan.address(region), *common]
            env = {**os.environ, **wan.env(region), "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
            log = open(logs / f"{engine}-ppr{ppr}-rank{rank}.log", "w")  # noqa: SIM115 (closed with the process)
            pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True} if rank == 0 else {"stdout": log}
            procs.append(subprocess.Popen(wan.exec_argv(region, argv), env=env, stderr=log, **pipes))
        rank0 = procs[0]
        assert rank0.stdout is not None and rank0.stdin is not None
        before: dict = {}
        load = 0.0
        roles = {"forwarder": [wan.forwarder_pid or 0]}
        for rank, proc in enumerate(procs):
            roles.setdefault(REGIONS[rank % n], []).append(proc.pid)  # ``ip netns exec`` execs: the worker's pid
        sampler: CpuSampler | None = None
        cpu: dict = {}
        while True:
            line = _readline(rank0.stdout, args.timeout)
            word = line.split(" ", 1)[0]
            if word == "BEGIN":
                before, dropped = wan.counters(), wan.dropped()
                sampler = CpuSampler(roles)
                sampler.start()
            elif word == "END":
                after = wan.counters()
                cpu = sampler.stop() if sampler is not None else {}
                cpu["dropped"] = {f"{a}>{b}": d - dropped[(a, b)] for (a, b), d in wan.dropped().items()}
                load = os.getloadavg()[0]
                crossed = {f"{a}>{b}": after[(a, b)][0] - before[(a, b)][0] for (a, b) in after}
            elif word == "RESULT":
                res = json.loads(line.split(" ", 1)[1])
                rows.append({**_row(res, crossed, load, ppr, wan, args), "cpu": cpu})
                _print_row(rows[-1])
                continue
            elif word == "DONE":
                break
            else:
                continue  # a library's chatter on stdout
            rank0.stdin.write("GO\n")
            rank0.stdin.flush()
    except (TimeoutError, RuntimeError) as e:
        tail = (logs / f"{engine}-ppr{ppr}-rank0.log").read_text()[-2000:]
        rows.append({"engine": engine, "ppr": ppr, "error": f"{e}; rank 0's log ends: {tail}"})
        print(f"{engine} ppr {ppr}: {e}\n{tail}", flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return rows


def _row(res: dict, crossed: dict[str, int], load: float, ppr: int, wan: Rehearsal, args: argparse.Namespace) -> dict:
    nbytes, times = res["bytes"], res["times_s"]
    med = statistics.median(times)
    b = bound_s(args.matrix_obj, REGIONS, nbytes)
    per_link = {k: round(v / len(times) / nbytes, 3) for k, v in crossed.items()}
    row = {
        "variant": res["variant"],
        "ppr": ppr,
        "mb": round(nbytes / 1e6, 1),
        "bytes": nbytes,
        "median_s": round(med, 3),
        "times_s": times,
        **{k: round(v, 3) for k, v in b.items()},
        "vs_bound": round(med / b["bound_s"], 3),
        "fill": round(b["transfer_s"] / (med - b["latency_s"]), 3) if med > b["latency_s"] else None,
        "max_link_B": max(per_link.values()),
        "link_B": per_link,
        "link_bytes": {k: round(v / len(times)) for k, v in crossed.items()},  # the control traffic, unrounded
        "load_1min": round(load, 2),
    }
    if "phases_s" in res:  # torchft and trainer-K: per region, each phase's median, and the first round's
        names = dict(enumerate(REGIONS))
        row["phases_s"] = {
            names[int(r)]: {k: v if k.startswith("first_") else round(statistics.median(v), 3) for k, v in ph.items()}
            for r, ph in res["phases_s"].items()
        }
        row["phases_median_s"] = row["phases_s"][REGIONS[0]]
    if "groups_s" in res:  # trainer-K: its groups made one after another (the baseline), then all at once
        row["groups_s"] = res["groups_s"]
    return row


def _print_row(r: dict) -> None:
    shown = {region: {k: v for k, v in ph.items() if v == v} for region, ph in r.get("phases_s", {}).items()}  # no NaN: no warm-up
    extra = "".join(f"\n    {r['variant']} in {region}: {ph}" for region, ph in shown.items())
    if "groups_s" in r:
        extra += f"\n    {r['variant']} groups made: serially {r['groups_s']['serial']} s, at once {r['groups_s']['at_once']} s"
    if r.get("cpu"):
        c = r["cpu"]
        cores = ", ".join(f"{k} {v}" for k, v in c["cores"].items())
        extra += f"\n    cpu over {c['window_s']} s: cores busy {c['busy']:.0%}, saturated {c['saturated']:.0%} of it; cores used: {cores}"
        extra += f"; packets dropped {sum(c['dropped'].values())}"
    fill = "-" if r["fill"] is None else f"{r['fill']:.0%}"
    print(
        f"{r['variant']:>10} ppr {r['ppr']} {r['mb']:>6.1f} MB: {r['median_s']:7.2f} s ({len(r['times_s'])} runs), bound "
        f"{r['bound_s']:.2f} s, {r['vs_bound']:.2f}x, fill {fill}, max link {r['max_link_B']:.2f}B, load {r['load_1min']}{extra}",
        flush=True,
    )


def table(res: dict) -> str:
    lines = [
        f"bound = {BOUND} (n = {len(REGIONS)}; slowest link {res['slowest']})",
        f"forwarder ceiling: {res['ceiling']['packets_per_s']:,} packets/s, {res['ceiling']['mb_per_s']:,} MB/s",
        "",
        "| variant | ranks/region | B | median | runs | bound | x bound | fill | max B on a directed link | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['ppr']} | error: {r['error'].splitlines()[0]} | | | | | | | |")
            continue
        fill = "-" if r["fill"] is None else f"{r['fill']:.0%}"
        lines.append(
            f"| {r['variant']} | {r['ppr']} | {r['mb']:g} MB | {r['median_s']:.2f} s | {len(r['times_s'])} | {r['bound_s']:.2f} s"
            f" | {r['vs_bound']:.2f}x | {fill} | {r['max_link_B']:.2f}B | {r['load_1min']} |"
        )
    ft = [r for r in res["rows"] if r.get("phases_s")]
    if ft:
        lines += ["", "phases per round, seconds (medians; first_*: the first round, which forms torchft's quorum and group):"]
        for r in ft:
            lines += [f"- {r['variant']}, {r['ppr']} ranks/region, {r['mb']:g} MB, {region}: {ph}" for region, ph in r["phases_s"].items()]
            if "groups_s" in r:
                g = r["groups_s"]
                lines.append(f"- {r['variant']}, {r['ppr']} ranks/region: groups made serially {g['serial']} s, at once {g['at_once']} s")
    return "\n".join(lines)


def _plans(args: argparse.Namespace, variants: list[str]) -> list[tuple[str, int, list[list[Any]]]]:
    """(engine, ppr, plan) per launch; sizes outer, so one size's variants run close in time."""
    sizes = [int(float(s) * 1e6) for s in args.sizes.split(",")]

    def plan(vs: list[str]) -> list[list[Any]]:
        once = [s >= args.once_from * 1e6 for s in sizes]
        return [[v, s, 0 if o else 1, 1 if o else args.repeats] for s, o in zip(sizes, once, strict=True) for v in vs]

    out = []
    one = [v for v in variants if v == "ring" or v.startswith("streams-")]
    two = [v for v in variants if v.startswith("sharded-")]
    trainer = [v for v in variants if v.startswith("trainer-")]  # 1 and 2 ranks per region (``--trainer-ppr``)
    ppr = {int(x) for x in getattr(args, "trainer_ppr", "1,2").split(",")}
    one, two = one + [v for v in trainer if 1 in ppr], two + [v for v in trainer if 2 in ppr]
    if one:
        out.append(("gloo", 1, plan(one)))
    if two:
        out.append(("gloo", 2, plan(two)))
    if "torchft" in variants:
        out.append(("torchft", 1, plan(["torchft"])))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--matrix", type=Path, default=ROOT / "bench" / "wan-matrix.toml")
    p.add_argument("--sizes", default="5.5,22,91,360", help="fp16 tensor sizes, MB")
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--once-from", type=float, default=300.0, help="sizes from this many MB on: one exchange, no warm-up")
    p.add_argument("--transport", choices=("gloo", "geoshard"), default="gloo", help="engine of the streams/sharded variants")
    p.add_argument("--torchft-python", type=Path, default=ROOT / ".venv-torchft" / "bin" / "python")
    p.add_argument("--timeout", type=float, default=900.0, help="bound on every wait, seconds")
    p.add_argument("--small", action="store_true", help="smoke run: 0.5 and 2 MB, 2 repeats")
    p.add_argument("--trainer-ppr", default="1,2", help="ranks per region the trainer-K variants run with: 1, 2 or 1,2 (both)")
    p.add_argument(
        "--no-groups-baseline", dest="groups_baseline", action="store_false", help="trainer-K: skip making its groups one by one first"
    )
    p.add_argument("--mtu", type=int, default=MTU, help="the regions' interfaces' MTU (1500: a real path's segments and windows)")
    p.add_argument(
        "--sysctl", action="append", default=[], metavar="KEY=VALUE", help="a net.* setting in every region's namespace (repeatable)"
    )
    p.add_argument("--idle", type=float, default=0.0, help="seconds every rank sleeps before each exchange (a DiLoCo round's H steps)")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "exchange_bench.json")
    args = p.parse_args()
    sysctls = dict(kv.split("=", 1) for kv in args.sysctl if "=" in kv)
    if len(sysctls) != len(args.sysctl):
        p.error("--sysctl takes KEY=VALUE")
    if args.small:
        args.sizes, args.repeats = "0.5,2", 2
    variants = args.variants.split(",")
    require_root()
    args.matrix_obj = load_matrix(args.matrix)
    if "torchft" in variants and not args.torchft_python.exists():
        print(f"exchange_bench: {args.torchft_python}: no torchft venv (see the docstring); skipping torchft", file=sys.stderr)
        variants.remove("torchft")
    logs = args.json_out.parent / "exchange-logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res: dict[str, Any] = {"bound": BOUND, "config": {k: str(v) for k, v in vars(args).items() if k != "matrix_obj"}, "rows": []}
    with Rehearsal(args.matrix_obj, regions=REGIONS, mtu=args.mtu, sysctls=sysctls) as wan:
        res["ceiling"] = {"packets_per_s": round(wan.ceiling.packets_per_s), "mb_per_s": round(wan.ceiling.mb_per_s, 1)}
        slow = min(args.matrix_obj.links, key=lambda link: (link.bandwidth_mbit, -link.latency_ms))
        res["slowest"] = f"{slow.a}<->{slow.b}, {slow.bandwidth_mbit:g} Mbit/s, {slow.latency_ms:g} ms one way"
        print(f"forwarder ceiling {res['ceiling']}; bound = {BOUND}", flush=True)
        for engine, ppr, plan in _plans(args, variants):
            res["rows"] += run_config(wan, engine, ppr, plan, args, logs)
        late = wan.lateness()
        res["lateness_ms"] = {"packets": late.packets, "mean": round(late.mean_ms, 3), "max": round(late.max_ms, 3)}
        res["dropped"] = {f"{a}>{b}": n for (a, b), n in wan.dropped().items()}
    res["seconds"] = round(time.monotonic() - t0, 1)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"JSON: {args.json_out} ({res['seconds']} s; worker logs {logs})")
    return 1 if any("error" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
