"""A short prepared run on a GPU node (issue 23: "where a GPU machine is lent, one short prepared run
with nccl"): what the trainer's DiLoCo path does with CUDA tensors, and what a round's local work
costs at a 1B-parameter model.

One GPU cannot run the cross-region exchange over NCCL (NCCL refuses two ranks of one communicator
on one device), so the run checks the parts one GPU can:

1. ``nccl``: a one-rank NCCL process group, DDP of the trainer's ``Net`` with the trainer's own comm
   hook (``timed_allreduce_hook``, fp16 on the wire) for some steps: the hook runs on NCCL and CUDA
   buffers, the loss falls. Baseline: the same steps without DDP, in the same run.
2. ``round_1b``: one outer round's local work on the GPU for ``--params`` parameters (default 10^9):
   the pseudo-gradient, each codec's encode (to bytes: the device-to-host copy included) and decode,
   the MAC's projections of one shard, the outer Nesterov step; times and peak GPU memory. Baseline:
   a plain device-to-host copy of the fp32 pseudo-gradient, in the same run.
3. ``p2p_cuda``: the peer-to-peer exchange (``sharded_allreduce``, gloo on loopback) between two
   processes, each a region of one rank, of a pseudo-gradient held on the GPU, against the same
   exchange of CPU tensors in the same run; the sum checked against the exact one.

Each part records its error instead of stopping the run (a part that fails on CUDA is the finding).
Writes ``--out`` (JSON) and prints one line per figure.

    python bench/gpu_check.py --out /tmp/gpu_check.json            # on the GPU node (~2-4 minutes)
    python bench/gpu_check.py --device cpu --params 2000000         # a dry run here
    python bench/gpu_check.py --parts round_1b                      # one part

On the lent H200 node (its image has torch; only google-crc32c travels, as a wheel in .whl/),
geoshard's import tree is made from the checkout's folders (loaders/ is geoshard.loaders, trainer/
is geoshard.trainer, as pyproject.toml maps them), and the script runs from outside the checkout so
that the source folder geoshard/ does not shadow that tree:

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    mkdir -p /tmp/pkg/geoshard && for f in geoshard/*; do ln -s $PWD/$f /tmp/pkg/geoshard/; done
    ln -s $PWD/loaders /tmp/pkg/geoshard/loaders; ln -s $PWD/trainer /tmp/pkg/geoshard/trainer
    cp bench/gpu_check.py /tmp/ && cd /tmp && PYTHONPATH=/tmp/site:/tmp/pkg python3 -P gpu_check.py --out $OUT/gpu_check.json

Run of 2026-12-04 (H200, torch 2.11.0+cu130, NCCL 2.28.9): docs/benchmarks.md, "GPU check".
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    """The median seconds of ``repeat`` calls (after one warm-up) and the last result."""
    out = fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def part(name: str, results: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as e:  # a part that fails is recorded, the others still run
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    results[name]["wall_s"] = round(time.perf_counter() - t0, 3)
    print(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'trace'})}", flush=True)


def nccl_ddp(device: torch.device, hidden: int, steps: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from geoshard.loaders.topology import Topology
    from geoshard.trainer.comm import CommState, timed_allreduce_hook
    from geoshard.trainer.model import INPUT_BYTES, Net

    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        x = torch.rand(256, INPUT_BYTES, device=device)
        y = torch.randint(0, 4, (256,), device=device)

        def train(wrap: bool) -> tuple[float, list[float], CommState | None]:
            torch.manual_seed(1)
            net: torch.nn.Module = Net(hidden).to(device)
            state = None
            if wrap:
                net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
                state = CommState(Topology.of(["us-east-1"]), compression="fp16")
                net.register_comm_hook(state, timed_allreduce_hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            losses = []
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            sync(device)
            return time.perf_counter() - t0, losses, state

        train(False)  # warm-up: CUDA's context, cuBLAS and the allocator, paid once (H200 run 1: DDP 0.32x 'plain')
        plain_s, plain_losses, _ = train(False)
        ddp_s, losses, state = train(True)
        assert state is not None
        return {
            "backend": backend,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
            "steps": steps,
            "hidden": hidden,
            "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
            "loss_fell": losses[-1] < losses[0],
            "hook_buckets": state.buckets,  # buckets the trainer's hook all-reduced over the run (0: it never ran)
            "ddp_s": round(ddp_s, 4),
            "plain_s": round(plain_s, 4),
            "ddp_over_plain": round(ddp_s / plain_s, 3),
            "same_losses_as_plain": max(abs(a - b) for a, b in zip(losses, plain_losses, strict=True)),
        }
    finally:
        dist.destroy_process_group()


def round_local(device: torch.device, params: int) -> dict[str, Any]:
    from geoshard.trainer.diloco import mac
    from geoshard.trainer.diloco.auth import Signer
    from geoshard.trainer.diloco.codec import ErrorFeedback, codec
    from geoshard.trainer.diloco.optimizer import OuterOptimizer
    from geoshard.trainer.diloco.settings import OuterSync

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out: dict[str, Any] = {"params": params}
    current = torch.randn(params, device=device)
    opt = OuterOptimizer(OuterSync(), bounds=None)  # type: ignore[arg-type]  # bounds: only load() reads them
    opt.reset(current + 0.01 * torch.randn(params, device=device), None)
    out["pseudo_gradient_s"], delta = timed(device, lambda: opt.params - current)
    out["d2h_fp32_s"], _ = timed(device, lambda: delta.cpu())
    out["d2h_fp32_gbps"] = round(params * 4 / out["d2h_fp32_s"] / 1e9, 2)
    for name in ("fp16", "bf16", "int8", "fp8"):
        c = codec(name)
        fb = ErrorFeedback(c, params)
        enc_s, payload = timed(device, partial(c.encode, delta), repeat=1)
        dec_s, back = timed(device, partial(c.decode, payload, params), repeat=1)
        ef_s, _ = timed(device, partial(fb.encode, delta), repeat=1)
        err = float((back.to(device) - delta).norm() / delta.norm())
        out[name] = {
            "bytes": len(payload),
            "encode_s": round(enc_s, 3),
            "decode_s": round(dec_s, 3),
            "encode_with_error_feedback_s": round(ef_s, 3),
            "encode_over_d2h": round(enc_s / out["d2h_fp32_s"], 2),
            "relative_error": round(err, 5),
        }
        del payload, back
    shard = delta[: params // 8]  # one owner's shard in a region of 8 ranks
    signer = Signer(b"k" * 32)
    out["mac_shard_values"] = shard.numel()
    out["mac_project_s"], _ = timed(device, lambda: mac.project(signer, "diloco/r/1/0", 0, shard), repeat=1)
    out["outer_step_s"], _ = timed(device, lambda: opt.step(delta / 3), repeat=3)
    out["state_bytes_on_device"] = 2 * params * 4
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    for k, v in list(out.items()):
        if k.endswith("_s") and isinstance(v, float):
            out[k] = round(v, 4)
    return out


def _exchange_worker(rank: int, port: int, device_name: str, numel: int, streams: int, q: Any) -> None:
    from geoshard.trainer.diloco.sharded import sharded_allreduce

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
        device = torch.device(device_name)
        g = torch.Generator().manual_seed(rank)
        flat = torch.randn(numel, generator=g).to(device)
        members = [("us-east-1", 1), ("eu-west-1", 1)]
        region = members[rank][0]
        sharded_allreduce(store, members, region, 0, flat, streams=streams, compression="fp16", tag="warm")
        t0 = time.perf_counter()
        total, sent = sharded_allreduce(store, members, region, 0, flat, streams=streams, compression="fp16", tag="timed")
        seconds = time.perf_counter() - t0
        want = sum(torch.randn(numel, generator=torch.Generator().manual_seed(r)).half().float() for r in range(2))
        err = float((total.float().cpu() - want).abs().max())
        q.put((rank, {"seconds": seconds, "sent": sent, "max_abs_error": err, "result_device": str(total.device)}))
    except Exception as e:  # reported by the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}))


def p2p_exchange(device: torch.device, numel: int, streams: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"numel": numel, "streams": streams}
    for dev in ("cpu", str(device)) if device.type == "cuda" else ("cpu",):
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_exchange_worker, args=(r, port, dev, numel, streams, q)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        out[dev] = got
    if device.type == "cuda" and all("seconds" in r for r in out[str(device)].values()):
        slow = max(r["seconds"] for r in out[str(device)].values())
        base = max(r["seconds"] for r in out["cpu"].values())
        out["cuda_over_cpu"] = round(slow / base, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--params", type=int, default=10**9)
    ap.add_argument("--exchange-params", type=int, default=64 * 10**6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench/_data/gpu_check.json"))
    ap.add_argument("--parts", default="", help="comma-separated: nccl, round_1b, p2p_cuda (default: all)")
    a = ap.parse_args()
    device = torch.device(a.device if a.device != "cuda" else "cuda:0")
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": sys.version.split()[0],
    }
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "nccl": lambda: nccl_ddp(device, a.hidden, a.steps),
        "round_1b": lambda: round_local(device, a.params),
        "p2p_cuda": lambda: p2p_exchange(device, a.exchange_params, a.streams),
    }
    chosen = a.parts.split(",") if a.parts else list(parts)
    unknown = [name for name in chosen if name not in parts]
    if unknown:
        ap.error(f"--parts: {', '.join(unknown)} is not one of {', '.join(parts)}")
    for name in chosen:
        part(name, results, parts[name])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if all(results[k]["ok"] for k in chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
