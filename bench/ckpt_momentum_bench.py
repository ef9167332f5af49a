"""The checkpoint's outer momentum under p2p (issue 23's leftovers): the extra peak memory a rank
takes while its region gathers the momentum shards for the leader's checkpoint.

One region of ``--ranks`` processes on 127.0.0.1 (plain gloo world, the region's training group),
the job's ``--shards`` S (default: the ranks; more when another region is bigger). Each rank holds
its shards of a flat fp32 vector of ``--sizes`` million values (three model sizes), then calls

- ``broadcast``: the gather as it was (commit f325d5e, kept here as the baseline): every shard
  broadcast over the group into a whole vector on every rank;
- ``leader``: ``geoshard.trainer.diloco.resume.gathered``, the owners sending their shards to the
  leader only, in pieces of ``resume.PIECE`` values;

each variant in fresh processes. A rank's extra peak memory is its peak RSS during the call
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus its RSS just before. The
leader checks every value it gathered, and every rank checks that one rank holding no momentum
gives None everywhere. Reported per size: the leader's and the largest non-leader's extra MB,
each variant's ratio to the baseline, seconds of the call, and the 1-minute load.

    .venv/bin/python bench/ckpt_momentum_bench.py                       # 4, 16, 64 M values, 4 ranks, ~1 min
    .venv/bin/python bench/ckpt_momentum_bench.py --sizes 16 --ranks 3 --shards 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geoshard.trainer.diloco.resume import PIECE, gathered
from geoshard.trainer.diloco.shards import Layout, owner

VARIANTS = ("broadcast", "leader")
MB = 1e6
TIMEOUT_S = 300


def broadcast_gathered(held: torch.Tensor | None, layout: Layout, group: Any, device: torch.device) -> torch.Tensor | None:
    """The baseline: resume.gathered as of commit f325d5e (the whole vector on every rank)."""
    flag = torch.tensor([0 if held is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if held is None or int(flag.item()) == 0:
        return None
    full = torch.zeros(layout.numel, dtype=torch.float32, device=device)
    i = 0
    for s in layout.mine:
        a, b = layout.span(s)
        full[a:b] = held[i : i + b - a].to(device)
        i += b - a
    for s in range(layout.shards):
        a, b = layout.span(s)
        dist.broadcast(full[a:b], group=group, group_src=owner(s, layout.n))
    return full.cpu()


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(a: argparse.Namespace) -> None:
    """One rank: its shards, the measured call, the checks; one JSON line on stdout."""
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", a.port, None, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"{a.variant}/{a.numel}/", store)
    dist.init_process_group("gloo", store=prefixed, rank=a.rank, world_size=a.ranks, timeout=timeout)
    group, cpu = dist.group.WORLD, torch.device("cpu")
    layout = Layout(a.numel, a.shards, a.ranks, a.rank)
    held = torch.cat([torch.arange(*layout.span(s), dtype=torch.float32) for s in layout.mine])
    fn = gathered if a.variant == "leader" else broadcast_gathered
    dist.barrier()
    rss0 = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    out = fn(held, layout, group, cpu)
    seconds = time.perf_counter() - t0
    extra = (_status_kb("VmHWM") - rss0) * 1024
    ok = (out is None) == (a.rank != 0 and a.variant == "leader")
    if out is not None:  # the whole vector, checked piece by piece
        ok = ok and all(
            torch.equal(out[c : c + PIECE], torch.arange(c, min(c + PIECE, a.numel), dtype=torch.float32)) for c in range(0, a.numel, PIECE)
        )
    del out
    none = fn(None if a.rank == a.ranks - 1 else held, layout, group, cpu)  # one rank without momentum
    ok = ok and none is None
    dist.barrier()
    rec = {"variant": a.variant, "rank": a.rank, "extra_bytes": extra, "own_bytes": 4 * layout.own_numel, "seconds": seconds, "ok": ok}
    print(json.dumps(rec), flush=True)
    dist.destroy_process_group()


def run(variant: str, numel: int, ranks: int, shards: int) -> list[dict[str, Any]]:
    """One variant in ``ranks`` fresh processes; their records, by rank."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    argv = [sys.executable, __file__, "--worker", "--variant", variant, "--numel", str(numel)]
    argv += ["--ranks", str(ranks), "--shards", str(shards), "--port", str(store.port)]
    procs = [subprocess.Popen([*argv, "--rank", str(k)], stdout=subprocess.PIPE, text=True) for k in range(ranks)]
    recs = []
    for k, p in enumerate(procs):
        out, _ = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise SystemExit(f"ckpt_momentum_bench: rank {k} of {variant} at {numel:,} values exited {p.returncode}")
        recs.append(json.loads(out.strip().splitlines()[-1]))
    return recs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4,16,64", help="model sizes, millions of fp32 values, comma-separated")
    p.add_argument("--ranks", type=int, default=4, help="ranks in the region")
    p.add_argument("--shards", type=int, default=0, help="the job's S (default: --ranks)")
    p.add_argument("--json-out", type=Path, help="the raw records")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("variant", "numel", "rank", "port"):
        p.add_argument(f"--{name}", type=str if name == "variant" else int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.shards = a.shards or a.ranks
        worker(a)
        return
    shards = a.shards or a.ranks
    print(f"checkpoint momentum gather: {a.ranks} ranks, S={shards}, gloo on 127.0.0.1, pieces of {PIECE * 4 / 2**20:.0f} MiB")
    print(f"{'values':>12} {'variant':>9} {'leader MB':>10} {'other MB':>9} {'own MB':>7} {'seconds':>8} {'load':>5}  checked")
    rows = []
    for size in (float(x) for x in a.sizes.split(",")):
        numel = int(size * 1e6)
        got = {}
        for v in VARIANTS:
            load = os.getloadavg()[0]
            recs = run(v, numel, a.ranks, shards)
            others = max(r["extra_bytes"] for r in recs[1:]) if len(recs) > 1 else 0
            got[v] = (recs[0]["extra_bytes"], others)
            secs = max(r["seconds"] for r in recs)
            ok = "yes" if all(r["ok"] for r in recs) else "NO"
            own = recs[-1]["own_bytes"]
            lead = recs[0]["extra_bytes"] / MB
            print(f"{numel:>12,} {v:>9} {lead:>10.1f} {others / MB:>9.1f} {own / MB:>7.1f} {secs:>8.2f} {load:>5.1f}  {ok}")
            rows.append({"numel": numel, "ranks": a.ranks, "shards": shards, "load": load, "records": recs})
        (lb, ob), (ll, ol) = got["broadcast"], got["leader"]
        print(f"{numel:>12,} {'ratio':>9} {ll / max(lb, 1):>10.2f} {ol / max(ob, 1):>9.3f}  (leader / broadcast)")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
