"""One process of bench/exchange_bench.py, run inside its region's namespace (not run by hand).

It imports torch (and torchft for ``--engine torchft``) and nothing of geoshard, so the same file
runs in the project's venv and in the separate torchft venv. Rank ``k * n + r`` is process k of
region r (n regions). All ranks share one plain gloo world (rendezvous on rank 0's address) for
barriers and for gathering times; each variant's exchange runs on its own groups.

Rank 0 talks to the bench over stdin/stdout, one line each way, so the bench can read the
forwarder's counters around exactly the timed repeats:
``BEGIN <variant> <bytes>`` / ``END ...`` (the bench answers ``GO``), ``RESULT <json>``, ``DONE``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# The value process k of region r holds: the same in every process of a region (DDP replicas hold
# the same pseudo-gradient), so every variant's correct sum is the same.
SUM = {n: n * (n + 1) / 2 for n in range(1, 9)}


class Ctx:
    """This rank's place and groups."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n, self.ppr, self.rank = args.regions, args.ppr, args.rank
        self.region, self.k = self.rank % self.n, self.rank // self.n
        self.timeout = timedelta(seconds=args.timeout)
        self.ring: Any = None
        self.streams: list[Any] = []  # K groups over the regions' first processes
        self.cross: list[list[Any]] = []  # cross[k][s]: process k of every region, stream s
        self.local: list[Any] = []  # local[r]: region r's processes
        self.manager: Any = None  # torchft's Manager, one per region
        self.lighthouse: Any = None  # torchft's Lighthouse (rank 0 only)
        self.group_store: Any = None  # the region's own store, which torchft's Manager joins
        self.trainer: Any = None  # trainer-K: (store, layout, groups, region group, signer, calls)
        self.groups_s: dict[str, float] = {}  # trainer-K: seconds to make its groups, serially and at once


def _rendezvous(ctx: Ctx) -> None:
    a = ctx.args
    store = dist.TCPStore(a.store_addr, a.store_port, a.world, is_master=ctx.rank == 0, timeout=ctx.timeout)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=a.world, timeout=ctx.timeout)


def _groups(ctx: Ctx, variants: list[str]) -> None:
    """Every rank creates every group in the same order (torch's rule for new_group)."""
    n, ppr = ctx.n, ctx.ppr
    leaders = list(range(n))
    k_streams = max([_streams(v) for v in variants if v.startswith("streams-")] or [1])
    s_streams = max([_streams(v) for v in variants if v.startswith("sharded-")] or [0])
    if any(v.startswith("trainer-") for v in variants):
        s_streams = max(s_streams, 1)  # the region groups (the trainer's own cross groups come from the store)
    ctx.ring = dist.new_group(leaders, timeout=ctx.timeout)
    ctx.streams = [ctx.ring] + [dist.new_group(leaders, timeout=ctx.timeout) for _ in range(k_streams - 1)]
    if s_streams:
        ctx.cross = [[dist.new_group([k * n + r for r in range(n)], timeout=ctx.timeout) for _ in range(s_streams)] for k in range(ppr)]
        ctx.local = [dist.new_group([k * n + r for k in range(ppr)], timeout=ctx.timeout) for r in range(n)]


def _streams(variant: str) -> int:
    return int(variant.split(".", 1)[0].rsplit("-", 1)[1])


TRAINER_SWITCHES = frozenset({"nomac", "nostage", "prepub", "whole", "threads"})


def _switches(variant: str) -> frozenset[str]:
    """``trainer-K.a.b``'s switches (``TRAINER_SWITCHES``): parts of the trainer's path left out or
    moved, one at a time, to find what holds its transfer back (docs/benchmarks.md)."""
    out = frozenset(variant.split(".")[1:])
    if out - TRAINER_SWITCHES:
        raise ValueError(f"unknown switches {sorted(out - TRAINER_SWITCHES)} in {variant!r} (known: {sorted(TRAINER_SWITCHES)})")
    return out


def _wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


def exchange_gloo(ctx: Ctx, variant: str, t: torch.Tensor) -> None:
    """One exchange of ``t`` (summed in place) with torch.distributed's gloo groups."""
    if variant == "ring":
        if ctx.k == 0:
            dist.all_reduce(t, group=ctx.ring)
    elif variant.startswith("streams-"):
        if ctx.k == 0:
            chunks = t.tensor_split(_streams(variant))
            _wait_all([dist.all_reduce(c, group=g, async_op=True) for c, g in zip(chunks, ctx.streams, strict=False)])
    elif variant.startswith("sharded-"):
        halves = list(t.tensor_split(ctx.ppr))
        mine = halves[ctx.k]
        chunks = mine.tensor_split(_streams(variant))
        _wait_all([dist.all_reduce(c, group=g, async_op=True) for c, g in zip(chunks, ctx.cross[ctx.k], strict=False)])
        if ctx.ppr > 1:  # in-region: no link crossed
            dist.all_gather(halves, mine, group=ctx.local[ctx.region])
    else:
        raise ValueError(f"unknown variant {variant!r}")


def trainer_setup(ctx: Ctx, variant: str, t: torch.Tensor) -> None:
    """``trainer-K``'s groups, once per variant and size (as the trainer makes them once per
    membership), before any timed exchange."""
    from geoshard.trainer.diloco.auth import Signer
    from geoshard.trainer.diloco.groups import Bind, GroupCache
    from geoshard.trainer.diloco.sharded import Membership, ShardGroups, make_groups
    from geoshard.trainer.diloco.shards import Layout

    store = dist.distributed_c10d._get_default_store()
    layout = Layout(t.numel(), ctx.ppr, ctx.ppr, ctx.k)
    members = Membership(tuple((str(r), ctx.ppr) for r in range(ctx.n)), "bench")
    bind = Bind(hostname=ctx.args.address)
    prefix, timeout = f"trainer/{variant}/{t.numel()}", ctx.args.timeout
    # the baseline: the same groups made one after another (as before), then the trainer's, all at once
    serial = ShardGroups(store, prefix + "/serial", layout, members, str(ctx.region), _streams(variant), bind, timeout, GroupCache())
    dist.barrier()
    t0 = time.perf_counter()
    if ctx.args.groups_baseline:
        for s in layout.mine:
            for c in range(len(serial.pieces(s))):
                serial.group(s, c)
    dist.barrier()
    t1 = time.perf_counter()
    groups = ShardGroups(store, prefix, layout, members, str(ctx.region), _streams(variant), bind, timeout, GroupCache())
    make_groups(groups, layout.mine)
    dist.barrier()
    ctx.groups_s = {"groups_serial": t1 - t0 if ctx.args.groups_baseline else float("nan"), "groups": time.perf_counter() - t1}
    del serial
    region = ctx.local[ctx.region] if ctx.ppr > 1 else None
    ctx.trainer = (store, layout, groups, region, Signer(b"exchange-bench-secret-0123456789abcdef"), [0])


def exchange_trainer(ctx: Ctx, variant: str, t: torch.Tensor, phases: dict[str, list[float]]) -> None:
    """``trainer-K``: the trainer's own p2p path (trainer/diloco/sharded.py, pipeline.py and mac.py,
    as p2p.py runs them): its shards' groups made once and reused, each shard in waves cut over the
    chunks ``K`` streams per region pair give, the MAC projections of the contribution signed and
    published in the store while the waves travel, each wave projected, stepped into staging and
    its gather in the region posted as it lands, the sum checked against every region's, the
    region's agreement flag, the commit. The step is SGD with lr 1 and momentum without Nesterov on
    zero parameters and a zero buffer, so the committed parameters are exactly minus the sum (the
    bench's check holds). Geoshard is imported here only, so the torchft venv never needs it.

    Switches (``trainer-K.nomac.nostage``, one experiment each): ``nomac`` leaves out the MAC
    (no publish, no projection of the sum, no check); ``nostage`` the staged step (the sum is
    gathered in the region as it is); ``prepub`` computes and sets the projections before the
    transfer starts instead of while it runs; ``whole`` waits for a wave's every chunk before its
    pass (otherwise each chunk's pass runs as it lands, as p2p.py does); ``threads`` runs the
    passes with torch's default intra-op threads instead of p2p.py's one (``pipeline.one_thread``). Within ``transfer``:
    ``chunk1`` and ``wire`` until the first and the last chunk was seen landed, ``tail`` the pass
    left after the last, ``landed`` every pass on what landed (MAC buckets, staged step, gather
    posting), under the wire or after it."""
    from geoshard.trainer.diloco import mac, pipeline
    from geoshard.trainer.diloco.pipeline import Gather, Pipeline
    from geoshard.trainer.diloco.settings import OuterSync
    from geoshard.trainer.diloco.sharded import gather_in_region, region_max, start_waves, wave_count

    store, layout, groups, region, signer, count = ctx.trainer
    switches = _switches(variant)
    one_thread = getattr(pipeline, "one_thread", None)  # trainer code from this change on
    if one_thread is not None:  # ``threads``: torch's default (one a core) for the passes, as before; else p2p.py's 1
        pipeline.PASS_THREADS = torch.get_num_threads() if "threads" in switches else 1  # type: ignore[attr-defined]
    use_mac, staged = "nomac" not in switches, "nostage" not in switches
    count[0] += 1
    tag = f"{variant}/{t.numel()}/{count[0]}"
    t0 = time.perf_counter()
    gather = Gather(layout, region, wave_count(layout)) if staged else None
    values = {s: t[slice(*layout.span(s))] for s in layout.mine}

    contributed = {s: v.clone() for s, v in values.items()} if use_mac else {}  # the sum lands in place

    def publish() -> None:
        for s, v in contributed.items():
            with one_thread() if one_thread is not None else contextlib.nullcontext():  # as p2p.py
                projections = mac.project(signer, tag, s, v, keep=True)
            store.set(f"trainer/mac/{tag}/{s}/{ctx.region}", mac.encode_projections(projections))

    if use_mac and "prepub" in switches:
        publish()
    works, spans, _ = start_waves(groups, values)
    if use_mac and "prepub" not in switches:
        publish()
    pipe = Pipeline(layout, signer, tag, values, spans)
    if not use_mac:
        pipe.projectors = {s: _NoProjector() for s in values}  # type: ignore[misc]
    own = layout.own_numel
    sync = OuterSync(outer_lr=1.0, outer_momentum=0.5, nesterov=False)
    if gather is not None:
        pipe.stage(gather, torch.zeros(own), torch.zeros(own), 1, sync)
    t1 = time.perf_counter()

    def fetch() -> dict[int, list[list[float]]]:  # as p2p.py: the projections read while the waves travel
        out = {}
        for s in values:
            keys = [f"trainer/mac/{tag}/{s}/{r}" for r in range(ctx.n)]
            store.wait(keys, ctx.timeout)
            out[s] = [mac.decode_projections(x) for x in store.multi_get(keys)]
        return out

    landed = 0.0
    in_order = "whole" not in switches and hasattr(pipe, "land")  # ``land``: trainer code from this change on
    with ThreadPoolExecutor(1) as pool:
        fetched = pool.submit(fetch) if use_mac else None
        for w, wave in enumerate(works):
            if in_order:  # as p2p.py: each chunk's pass as it lands, while the later ones travel
                done = []
                for i, work in enumerate(wave):
                    work.wait()
                    done.append(time.perf_counter())
                    pipe.land(w, i)
                    landed += time.perf_counter() - done[-1]
            else:  # the whole wave first, then its pass (as p2p.py did before chunks landed one by one)
                done = _completion_times(wave)
            wire_end = done[-1]
            if w == 0:  # when the wave's first chunk landed: how far apart the streams end
                phases.setdefault("chunk1", []).append(done[0] - t1)
            a = time.perf_counter()
            pipe.landed(w)
            landed += time.perf_counter() - a
        t2 = time.perf_counter()
        published = fetched.result() if fetched is not None else {}
    if use_mac:
        got = pipe.projections()
        for s, v in values.items():
            mac.check_projected(got[s], v, published[s], "fp16")
    t3 = time.perf_counter()
    if gather is not None:
        if not gather.finish(pipe.landed_waves):
            raise RuntimeError("trainer: the staged gather failed")
        full = gather.full
    else:
        full, _ = gather_in_region(region, layout, {s: v.float() for s, v in values.items()})
    ok = region_max(region, 0) == 0  # the region's agreement flag
    t4 = time.perf_counter()
    if ok:  # the commit: the new parameters (minus the sum, see above), or the sum unstaged
        t.copy_(full.neg() if gather is not None else full)
    t5 = time.perf_counter()
    spans_s = (("mac_publish", t0, t1), ("transfer", t1, t2), ("mac_check", t2, t3), ("gather", t3, t4), ("commit", t4, t5))
    for name, a, b in spans_s:
        phases.setdefault(name, []).append(b - a)
    phases.setdefault("wire", []).append(wire_end - t1)  # until the last chunk was seen landed
    phases.setdefault("tail", []).append(t2 - wire_end)  # the pass left after it
    phases.setdefault("landed", []).append(landed)  # every pass on what landed, under the wire or not


def _completion_times(works: list[Any], poll_s: float = 0.005) -> list[float]:
    """Wait for every work, polling: when each was done (perf_counter), sorted."""
    pending, done = list(works), []
    while pending:
        for w in [w for w in pending if w.is_completed()]:
            w.wait()  # raises if it failed
            done.append(time.perf_counter())
            pending.remove(w)
        if pending:
            time.sleep(poll_s)
    return sorted(done)


class _NoProjector:
    """``trainer-K.nomac``: a MAC bucket that takes the waves and does nothing."""

    def add(self, x: torch.Tensor) -> None:
        pass


def exchange_quantized(ctx: Ctx, variant: str, t: torch.Tensor, phases: dict[str, list[float]]) -> None:
    """``trainer-int8-K``: the trainer's int8 p2p path (trainer/diloco/quantized.py, as p2p.py runs it
    for ``--outer-compression int8``) on ``trainer-K``'s groups: each shard encoded with error
    feedback, a reduce-scatter and an all-gather in int8 bytes with every piece's HMAC digest signed
    in the store and checked, then the in-region gather. The same values as fp16's ``B``: the
    bytes that travel are about half."""
    from geoshard.trainer.diloco.codec import codec
    from geoshard.trainer.diloco.kv import KV
    from geoshard.trainer.diloco.quantized import Quantized, Where
    from geoshard.trainer.diloco.sharded import gather_in_region

    store, layout, groups, region, signer, count = ctx.trainer
    count[0] += 1
    q = Quantized(codec("int8"), KV(store, f"trainerq/{t.numel()}/{count[0]}", signer), True, ctx.args.timeout)
    names = tuple(str(r) for r in range(ctx.n))
    t0 = time.perf_counter()
    chunks, bad = q.prepare(groups, {s: t[slice(*layout.span(s))].float() for s in layout.mine}, ctx.n)
    t1 = time.perf_counter()
    out, _, why = q.exchange(Where(0, 0, "bench", ctx.region, names), chunks)
    if why or bad:
        raise RuntimeError(f"{variant}: refused: {why or bad}")
    t2 = time.perf_counter()
    own = {s: torch.cat(out[s]) for s in layout.mine}
    if region is not None:
        full, _ = gather_in_region(region, layout, own)
        t.copy_(full)
    else:
        for s, v in own.items():
            t[slice(*layout.span(s))] = v
    t3 = time.perf_counter()
    for name, a, b in (("encode", t0, t1), ("exchange", t1, t2), ("gather", t2, t3)):
        phases.setdefault(name, []).append(b - a)


def exchange_geoshard(ctx: Ctx, variant: str, t: torch.Tensor) -> None:
    """HOOK for ``--transport geoshard``: call the project's peer-to-peer exchange here.

    Wire the outer exchange of trainer/diloco/ (``--outer-streams``; issue 23) once it lands: it
    should sum ``t`` in place across regions, process ctx.k owning shard k, with the variant's
    stream count (``_streams(variant)``), so the bench's timing, bytes and checks apply unchanged.
    """
    raise NotImplementedError("--transport geoshard: exchange_geoshard in bench/exchange_worker.py is not wired yet")


# -- torchft -----------------------------------------------------------------------------------


def torchft_setup(ctx: Ctx) -> None:
    """Lighthouse in rank 0's process (us-east-1's address); a Manager per region (one rank each)."""
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    a = ctx.args
    if ctx.rank == 0:
        ctx.lighthouse = LighthouseServer(bind=f"{a.address}:{a.lighthouse_port}", min_replicas=ctx.n, join_timeout_ms=60_000)
    dist.barrier()  # the Lighthouse listens before any Manager calls it
    ctx.group_store = dist.TCPStore(a.address, a.group_store_port, 1, is_master=True, timeout=ctx.timeout)
    ctx.manager = Manager(
        pg=ProcessGroupGloo(timeout=ctx.timeout),
        load_state_dict=lambda _state: None,
        state_dict=lambda: {},
        min_replica_size=ctx.n,
        use_async_quorum=False,
        timeout=ctx.timeout,
        quorum_timeout=ctx.timeout,
        connect_timeout=ctx.timeout,
        rank=0,
        world_size=1,
        store_addr=a.address,
        store_port=a.group_store_port,
        lighthouse_addr=f"http://{a.store_addr}:{a.lighthouse_port}",
        replica_id=f"region{ctx.region}",
        hostname=a.address,
        port=a.manager_port,
        init_sync=False,
    )


def exchange_torchft(ctx: Ctx, variant: str, t: torch.Tensor, phases: dict[str, list[float]]) -> None:
    """One torchft round as its DiLoCo does it: quorum, allreduce (averages), should_commit."""
    m = ctx.manager
    t0 = time.perf_counter()
    m.start_quorum()
    t1 = time.perf_counter()
    m.allreduce(t).wait()
    t2 = time.perf_counter()
    if not m.should_commit():
        raise RuntimeError("torchft: should_commit returned False")
    t3 = time.perf_counter()
    for name, s in (("quorum_s", t1 - t0), ("allreduce_s", t2 - t1), ("commit_s", t3 - t2)):
        phases.setdefault(name, []).append(s)


# -- the harness -------------------------------------------------------------------------------


def _handshake(ctx: Ctx, line: str) -> None:
    """Rank 0 tells the bench and waits (bounded) for its GO; the others wait in the barrier."""
    dist.barrier()
    if ctx.rank == 0:
        print(line, flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], ctx.args.timeout)
        if not ready or sys.stdin.readline().strip() != "GO":
            raise RuntimeError(f"no GO from the bench after {line!r}")
    dist.barrier()


def measure(ctx: Ctx, variant: str, nbytes: int, warmup: int, repeats: int) -> dict[str, Any]:
    numel = nbytes // 2 // 64 * 64  # fp16; even halves and chunks
    t = torch.empty(numel, dtype=torch.float16)
    phases: dict[str, list[float]] = {}
    run: Callable[[], None]
    if variant == "torchft":
        expect = SUM[ctx.n] / ctx.n  # torchft averages

        def run() -> None:
            exchange_torchft(ctx, variant, t, phases)
    elif variant.startswith("trainer-"):
        expect = SUM[ctx.n]
        trainer_setup(ctx, variant, t)  # not timed: at sizes run once (no warm-up) it would be

        def run() -> None:
            (exchange_quantized if variant.startswith("trainer-int8-") else exchange_trainer)(ctx, variant, t, phases)
    else:
        expect = SUM[ctx.n]
        # The ring stays gloo's: it is the baseline any transport is measured against.
        engine = exchange_geoshard if ctx.args.transport == "geoshard" and variant != "ring" else exchange_gloo

        def run() -> None:
            engine(ctx, variant, t)

    participates = (variant != "ring" and not variant.startswith("streams-")) or ctx.k == 0
    for _ in range(warmup):
        t.fill_(ctx.region + 1)
        time.sleep(ctx.args.idle)  # the exchange's own connections idle (the barrier's are the default group's)
        dist.barrier()
        run()
    if warmup and participates and not bool((t == expect).all()):
        raise RuntimeError(f"{variant}: wrong sum on rank {ctx.rank}: {t[:4].tolist()} != {expect}")
    first = {k: v[0] for k, v in phases.items()}  # torchft's first round forms the quorum and its group
    phases.clear()
    times = []
    _handshake(ctx, f"BEGIN {variant} {numel * 2}")
    for _ in range(repeats):
        t.fill_(ctx.region + 1)
        time.sleep(ctx.args.idle)
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    _handshake(ctx, f"END {variant} {numel * 2}")
    if participates and not bool((t == expect).all()):
        raise RuntimeError(f"{variant}: wrong sum on rank {ctx.rank}: {t[:4].tolist()} != {expect}")
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the exchange ends when its last rank has it
    out: dict[str, Any] = {"variant": variant, "bytes": numel * 2, "times_s": [round(x, 4) for x in slowest.tolist()]}
    if variant.startswith("trainer-"):  # the slowest rank's, from barrier to barrier
        made = torch.tensor([ctx.groups_s["groups_serial"], ctx.groups_s["groups"]], dtype=torch.float64)
        dist.all_reduce(made, op=dist.ReduceOp.MAX)
        serial = float(made[0])
        out["groups_s"] = {"serial": None if serial != serial else round(serial, 3), "at_once": round(float(made[1]), 3)}
    if phases:  # every rank's, by region (torchft: one rank per region); tensors, as torchft's venv has no numpy
        names = sorted(phases)
        mine = torch.tensor([first.get(k, float("nan")) for k in names] + [x for k in names for x in phases[k]], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(ctx.args.world)]
        dist.all_gather(every, mine)
        out["phases_s"] = {}
        for rank, e in enumerate(every):
            vals = [round(x, 4) for x in e.tolist()]
            per = {f"first_{k}": vals[i] for i, k in enumerate(names)}
            per.update({k: vals[len(names) + i * repeats : len(names) + (i + 1) * repeats] for i, k in enumerate(names)})
            out["phases_s"][str(rank % ctx.n)] = per
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("gloo", "torchft"), default="gloo")
    p.add_argument("--transport", choices=("gloo", "geoshard"), default="gloo")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--regions", type=int, required=True)
    p.add_argument("--ppr", type=int, default=1)
    p.add_argument("--address", required=True, help="this region's address")
    p.add_argument("--store-addr", required=True, help="rank 0's region's address")
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--lighthouse-port", type=int, default=0)
    p.add_argument("--group-store-port", type=int, default=0)
    p.add_argument("--manager-port", type=int, default=0)
    p.add_argument("--plan", required=True, help="JSON list of [variant, bytes, warmup, repeats]")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--idle", type=float, default=0.0, help="seconds to sleep before each exchange")
    p.add_argument("--no-groups-baseline", dest="groups_baseline", action="store_false", help="trainer-K: skip the serial groups")
    args = p.parse_args()
    ctx = Ctx(args)
    plan = json.loads(args.plan)
    try:
        _rendezvous(ctx)
        if args.engine == "torchft":
            torchft_setup(ctx)
        else:
            _groups(ctx, sorted({v for v, *_ in plan}))
        for variant, nbytes, warmup, repeats in plan:
            res = measure(ctx, variant, nbytes, warmup, repeats)
            if ctx.rank == 0:
                print("RESULT " + json.dumps(res), flush=True)
        dist.barrier()
        if ctx.rank == 0:
            print("DONE", flush=True)
    except NotImplementedError as e:
        print(f"exchange_worker: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    if ctx.manager is not None:
        ctx.manager.shutdown(wait=False)
    os._exit(0)  # skip gloo's and torchft's teardown: the bench stops the namespaces anyway


if __name__ == "__main__":
    raise SystemExit(main())
