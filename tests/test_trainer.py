"""The trainer end to end: two gloo ranks under torchrun learn and report (directly and through
``geoshard train``); gradient accumulation and the fp16 gradient exchange against plain DDP (in
this process); a resumed run against an uninterrupted one; a rank SIGKILLed under torchrun
``--max-restarts 1``; and a slow Alluxio tier that puts a run over its IO-wait budget.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from alluxio_standin import AlluxioWorkerStandIn
from click.testing import CliRunner
from killkit import descendants, rank_processes
from servers import closed_port, free_ports
from test_loaders import EU, region_samples, split
from torch.nn.parallel import DistributedDataParallel as DDP

from geoshard.cli import main
from geoshard.loaders import RegionalDataset
from geoshard.loaders.topology import Topology
from geoshard.local.synth import NUM_CLASSES
from geoshard.trainer.checkpoint import CheckpointStore
from geoshard.trainer.comm import CommState, timed_allreduce_hook
from geoshard.trainer.loop import forward_backward
from geoshard.trainer.model import INPUT_BYTES, Net

BATCH = 16
CHANCE = math.log(NUM_CLASSES)  # cross-entropy of an untrained model: ln 10
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 samples over three regions; eu-west-1 has 781: 390 per rank of two, 25 batches of 16 (24 full)."""
    return split(tmp_path_factory.mktemp("corpus"), samples=3000)


# -- running the trainer ------------------------------------------------------------------------


def torchrun_argv(plan: Path, out: Path, *args: object, max_restarts: int = 0) -> list[str]:
    """torchrun with two ranks as ``geoshard train`` starts it (static rendezvous), or with restarts
    as they work: see ``RESTARTABLE``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", str(max_restarts)]
    port = str(free_ports(1)[0])
    if max_restarts:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    else:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", port]
    cmd += ["-m", "geoshard.trainer"]
    cmd += ["--plan", str(plan), "--region", EU, "--out", str(out), "--batch-size", str(BATCH), "--backend", "gloo"]
    return cmd + [str(a) for a in args]


@contextlib.contextmanager
def launched(argv: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """torchrun running with its output in ``log`` (a file: orphaned DataLoader workers of a killed
    rank would hold a pipe open); stopped with SIGTERM, which it passes on to its ranks, if the
    test leaves early."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def train(plan: Path, out: Path, *args: object, timeout: float = 240) -> str:
    """Run two ranks to the end; their output."""
    log = out.with_name(out.name + f"-{time.monotonic_ns()}.log")
    with launched(torchrun_argv(plan, out, *args), log, cwd=out.parent) as proc:
        code = proc.wait(timeout=timeout)
    text = log.read_text()
    assert code == 0, text[-5000:]
    return text


# Restarted ranks must not share the agent's TCPStore with their predecessors: the process group's
# keys carry no attempt, so a restarted rank 0 can read the address the killed rank 1 published
# and connect to it (held open by its orphaned DataLoader workers until they notice; then
# "Connection reset by peer"), pytorch/pytorch#135712. The static rendezvous (--master-port)
# always shares it; c10d shares it unless told not to.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def epoch_batches(plan: Path) -> list[int]:
    """Samples in each batch of a rank's epoch (the last one is short)."""
    ds = RegionalDataset(plan, region=EU, rank=0, world_size=2, batch_size=BATCH)
    n = len(ds)
    return [BATCH] * (n - 1) + [ds.samples_per_epoch - BATCH * (n - 1)]


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def report_of(run: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run / "report.json").read_text())
    return data


def latest(run: Path) -> tuple[int, dict[str, Any]]:
    found = CheckpointStore(str(run / "checkpoints")).load_latest()
    assert found is not None, f"no checkpoint in {run}"
    return found


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# -- 1. two ranks learn, and the report accounts for the wall time --------------------------------

STEPS = 40  # the first epoch (25 batches of 16 per rank) and part of the next
FLAGS = ("--checkpoint-every", 10, "--log-keys")


@pytest.fixture(scope="module")
def uninterrupted(plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks train STEPS steps in one go: the run of test 1, and run A of test 3."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    train(plan, out, "--steps", STEPS, *FLAGS)
    return out


@pytest.mark.slow
def test_two_ranks_learn_and_the_report_accounts_for_the_wall_time(plan: Path, uninterrupted: Path) -> None:
    out = uninterrupted
    steps = {rank: records(out / f"steps-rank{rank}.jsonl") for rank in (0, 1)}
    assert [s["step"] for s in steps[0]] == [s["step"] for s in steps[1]] == list(range(1, STEPS + 1))
    sizes = epoch_batches(plan)
    assert [s["samples"] for s in steps[0]] == [s["samples"] for s in steps[1]] == [sizes[i % len(sizes)] for i in range(STEPS)]

    # Learning: the first 10 steps of both ranks start at chance; the last 10 are clearly lower.
    # (Deterministic on CPU: same seed, same data order; observed 2.30 -> 2.21.)
    first = mean([s["loss"] for r in steps.values() for s in r[:10]])
    last = mean([s["loss"] for r in steps.values() for s in r[-10:]])
    assert abs(first - CHANCE) < 0.15 and last < first - 0.05, (first, last)

    report = report_of(out)
    assert {"io_wait_share", "budget", "within_budget", "ranks", "time_to_first_batch_s"} <= report.keys()
    assert report["budget"] == 0.05 and report["within_budget"] == (report["io_wait_share"] <= 0.05)
    assert report["verdict"] == ("within budget" if report["within_budget"] else "over budget")
    assert report["world_size"] == 2 and report["complete"] and report["steps"] == STEPS
    assert report["samples"] == sum(s["samples"] for r in steps.values() for s in r)
    assert report["loss_first"] == pytest.approx(mean([steps[0][0]["loss"], steps[1][0]["loss"]]), abs=1e-5)

    b = report["breakdown"]
    parts = ("data_wait", "compute", "checkpoint", "other")  # disjoint; comm is part of compute
    assert all(0 <= b[k]["share"] <= 1 for k in (*parts, "comm"))
    assert 0 < report["io_wait_share"] < 1 and report["io_wait_share"] == b["data_wait"]["share"]
    wall = b["wall"]["seconds"]
    # The four components add up to the wall time (up to the report's rounding to the microsecond) ...
    assert sum(b[k]["seconds"] for k in parts) == pytest.approx(wall, abs=1e-4)
    assert sum(b[k]["share"] for k in parts) == pytest.approx(1.0, abs=1e-4)
    # ... and they are the step records' own sums, measured ones cover at least 90% of the wall
    # time: "other" (logging between steps) is a remainder, not where the time went.
    for k in ("data_wait", "compute", "checkpoint", "comm"):
        assert b[k]["seconds"] == pytest.approx(sum(s[f"{k}_s"] for r in steps.values() for s in r), abs=1e-4), k
    assert b["other"]["share"] < 0.1 and b["checkpoint"]["seconds"] > 0 and 0 < b["comm"]["seconds"] <= b["compute"]["seconds"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        measured = r["data_wait_s"] + r["compute_s"] + r["checkpoint_s"]
        assert measured <= r["wall_s"] + 1e-4, r  # so "other" was not clamped to hide an overrun
        assert r["other_s"] == pytest.approx(r["wall_s"] - measured, abs=1e-4)
        assert 0 <= r["io_wait_share"] <= 1 and r["finished"] and r["region"] == EU
        assert 0 < r["time_to_first_batch_s"] <= r["wall_s"]
    assert report["time_to_first_batch_s"] == max(r["time_to_first_batch_s"] for r in report["ranks"])
    png = (out / "report.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 2000


@pytest.mark.slow
def test_geoshard_train_launches_torchrun_with_accumulation_and_fp16_gradients(plan: Path, tmp_path: Path) -> None:
    # From pytest's working directory (the checkout under `make test`): `geoshard train` must start
    # the installed geoshard.trainer even where a geoshard/ source folder is in the current directory.
    out = tmp_path / "cli-run"
    args = ["train", "--plan", str(plan), "--region", EU, "--out", str(out), "--nproc", "2", "--steps", "12", "--backend", "gloo"]
    args += ["--batch-size", str(BATCH), "--accum-steps", "2", "--grad-compression", "fp16", "--fp32-after", "6", "--checkpoint-every", "6"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "IO wait: " in result.output and "2 rank(s) in eu-west-1, 12 steps (1..12), 768 samples" in result.output
    for rank in (0, 1):
        steps = records(out / f"steps-rank{rank}.jsonl")
        assert [s["step"] for s in steps] == list(range(1, 13))
        assert all(s["samples"] == 2 * BATCH for s in steps), "two micro-batches per optimizer step"
        # The all-reduce ran in every step (fp16 before step 6, fp32 from there on; what each
        # exchanges is checked in process below).
        assert all(s["comm_s"] > 0 for s in steps)
        # The step's loss is the mean over its micro-batches (each scaled by 1/accum), not their sum.
        assert abs(steps[0]["loss"] - CHANCE) < 0.15, steps[0]["loss"]
    step, state = latest(out)
    assert step == 12 and all(torch.isfinite(t).all() for t in state["model"].values())
    assert report_of(out)["steps"] == 12 and (out / "report.png").exists()


# -- 2. accumulation and the comm hook, in this process ------------------------------------------


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg-store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gradients(state: dict[str, torch.Tensor], comm: CommState, x: torch.Tensor, y: torch.Tensor, micro: int) -> list[torch.Tensor]:
    """The gradients of one optimizer step of DDP(Net()) from ``state``, over ``micro`` micro-batches."""
    net = Net()
    net.load_state_dict(state)
    ddp = DDP(net)
    ddp.register_comm_hook(comm, timed_allreduce_hook)
    for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
        forward_backward(ddp, xs, ys, micro, last=i == micro - 1)
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    assert len(grads) == len(list(net.parameters()))
    return grads


def test_accumulation_matches_the_large_batch_and_fp16_gradients_round_then_switch_to_fp32(one_rank: None) -> None:
    torch.manual_seed(0)
    state = Net().state_dict()
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(2 * 8, INPUT_BYTES, generator=g), torch.randint(0, NUM_CLASSES, (2 * 8,), generator=g)

    one = Topology.of(["eu-west-1"])
    full = CommState(one)
    big = gradients(state, full, x, y, micro=1)
    assert full.seconds > 0 and full.buckets >= 1, "the hook timed the all-reduce"
    buckets = full.buckets
    assert full.take()[0] > 0 and full.seconds == 0 and full.buckets == 0, "take() hands the step's time over and resets"
    assert any(t.abs().sum() > 0 for t in big)

    acc = CommState(one)
    two = gradients(state, acc, x, y, micro=2)  # two micro-batches of 8, accum 2
    assert acc.buckets == buckets, "only the last micro-batch all-reduces (no_sync on the first)"
    for a, b in zip(two, big, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # the same sums in another order

    half = CommState(one, "fp16", fp32_after_step=5)
    half.step = 4
    rounded = gradients(state, half, x, y, micro=1)
    for a, b in zip(rounded, big, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
        # One rank: the exchange is exactly a round trip through fp16.
        assert torch.equal(a, b.half().float())
    assert not all(torch.equal(a, b) for a, b in zip(rounded, big, strict=True)), "fp16 rounding must show somewhere"

    half.step = 5  # from fp32_after_step on: fp32 again, bit for bit
    exact = gradients(state, half, x, y, micro=1)
    assert all(torch.equal(a, b) for a, b in zip(exact, big, strict=True))


# -- 3. resume == uninterrupted --------------------------------------------------------------------


@pytest.mark.slow
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(plan: Path, uninterrupted: Path, tmp_path: Path) -> None:
    """Run A trains 40 steps; run B 20, then is relaunched with --resume --steps 40 in the same folder.

    Compared with torch.equal, not allclose: on the CPU with one thread per rank (torchrun's
    OMP_NUM_THREADS=1), the same seed, the same batches in the same order and a two-rank gloo sum
    (commutative, so exact), every floating-point operation repeats exactly; any difference means
    state was lost in the checkpoint (momentum, the loader's position, the epoch). The epoch
    boundary (25 batches) falls after the resume point.
    """
    assert STEPS // 2 < len(epoch_batches(plan)) < STEPS, "the epoch ends after the resume point"
    a, b = uninterrupted, tmp_path / "b"
    train(plan, b, "--steps", STEPS // 2, *FLAGS)
    assert latest(b)[0] == STEPS // 2
    log = train(plan, b, "--steps", STEPS, "--resume", *FLAGS)
    assert f"rank 0: resumed at step {STEPS // 2}" in log and f"rank 1: resumed at step {STEPS // 2}" in log

    (step_a, state_a), (step_b, state_b) = latest(a), latest(b)
    assert step_a == step_b == STEPS
    assert state_a["model"].keys() == state_b["model"].keys()
    for name, tensor in state_a["model"].items():
        assert torch.equal(tensor, state_b["model"][name]), name
    momentum_a, momentum_b = ([s["momentum_buffer"] for _, s in sorted(st["optimizer"]["state"].items())] for st in (state_a, state_b))
    assert len(momentum_a) == len(momentum_b) > 0 and all(map(torch.equal, momentum_a, momentum_b))
    assert state_a["loaders"] == state_b["loaders"]
    torch.manual_seed(0)  # the trainer's initial weights (--seed 0): training moved away from them
    assert not torch.equal(state_a["model"]["layers.0.weight"], Net().state_dict()["layers.0.weight"])
    for rank in (0, 1):
        # B's logs: the first launch's steps 1..20, then the second's 21..40, with A's losses and batches.
        for name, field in ((f"steps-rank{rank}.jsonl", "loss"), (f"keys-rank{rank}.jsonl", "keys")):
            ra, rb = records(a / name), records(b / name)
            assert [r["step"] for r in rb] == list(range(1, STEPS + 1)) == [r["step"] for r in ra]
            assert [r[field] for r in ra] == [r[field] for r in rb], (name, field)


# -- 4. a rank killed under torchrun --max-restarts 1 --------------------------------------------


def rank_pid(agent: int, rank: int) -> int | None:
    """The trainer process of ``rank`` among the torchrun agent's children (its RANK variable)."""
    want = f"\0RANK={rank}\0".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent:
                continue
            if b"geoshard.trainer" in (entry / "cmdline").read_bytes() and want in b"\0" + (entry / "environ").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def last_step(path: Path) -> int:
    """The step of the last complete line of a steps or keys log (0: none yet)."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    done = [json.loads(line)["step"] for line in lines if line.endswith("\n")]
    return done[-1] if done else 0


def kill_between_checkpoints(proc: subprocess.Popen[bytes], out: Path, every: int, steps: int, timeout: float = 120) -> int:
    """SIGKILL rank 1 once a checkpoint exists, while it is in a step that takes none; the step it died in.

    Rank 1 is stopped (SIGSTOP) while its logs are read, so the step it is in is known exactly:
    the one after its last record, when both logs have that record. A step that ends with a
    checkpoint is never chosen: the trainer writes a step's records after its checkpoint, so a
    rank killed between the two would leave a checkpoint covering a step its keys log lacks.
    """
    steps_log, keys_log = out / "steps-rank1.jsonl", out / "keys-rank1.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before rank 1 could be killed"
        pid = rank_pid(proc.pid, 1)
        if pid is None or last_step(steps_log) < every:
            time.sleep(0.01)
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        killed = False
        try:
            done = last_step(steps_log)
            if done == last_step(keys_log) and (done + 1) % every and done + 1 < steps:
                os.kill(pid, signal.SIGKILL)
                killed = True
                return done + 1
        finally:
            if not killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError(f"rank 1 was not killed within {timeout} s")


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_checkpoint_and_the_epoch_is_consumed_exactly_once(plan: Path, tmp_path: Path) -> None:
    ds = RegionalDataset(plan, region=EU, rank=0, world_size=2, batch_size=BATCH)
    steps, per_rank = len(ds), ds.samples_per_epoch  # one epoch: every batch of the rank's share, once
    every = 5
    assert steps >= 4 * every, "room for a checkpoint, a kill after it and steps to redo"
    out = tmp_path / "run"
    # --hidden 1024: steps of some tens of ms, so the job is still running when the test looks.
    flags = ("--steps", steps, "--checkpoint-every", every, "--log-keys", "--resume", "--hidden", 1024)
    argv = torchrun_argv(plan, out, *flags, max_restarts=1)
    log = tmp_path / "run.log"
    with launched(argv, log, cwd=tmp_path, env={**os.environ, **RESTARTABLE}) as proc:
        died_in = kill_between_checkpoints(proc, out, every, steps)
        code = proc.wait(timeout=240)
    text = log.read_text()
    assert code == 0, text[-5000:]
    checkpoint = (died_in - 1) // every * every  # the newest one when rank 1 died
    resumed = sorted(re.findall(r"rank (\d): resumed at step (\d+)", text))
    assert resumed == [("0", str(checkpoint)), ("1", str(checkpoint))], (died_in, resumed, text[-3000:])

    keys: Counter[str] = Counter()
    for rank in (0, 1):
        logged = records(out / f"keys-rank{rank}.jsonl")
        # The redone steps' first records were dropped on resume: every step once, in order.
        assert [r["step"] for r in logged] == list(range(1, steps + 1)), rank
        assert [r["step"] for r in records(out / f"steps-rank{rank}.jsonl")] == list(range(1, steps + 1)), rank
        keys.update(k for r in logged for k in r["keys"])
    region = {s["__key__"] for s in region_samples(plan.parent / "split" / EU, "wds")}
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1][:5]
    assert len(keys) == 2 * per_rank == len(region) - len(region) % 2 and set(keys) <= region
    assert latest(out)[0] == steps
    report = report_of(out)
    assert report["step_last"] == steps and report["complete"]


# -- 5. a slow tier goes over the IO-wait budget ------------------------------------------------

DELAY_S = 0.1  # per request to the Alluxio stand-in; a shard is one request
BUDGET = 0.4


@pytest.mark.slow
def test_a_slow_tier_puts_the_run_over_its_io_wait_budget(plan: Path, tmp_path: Path) -> None:
    """The same job twice through eu-west-1's Alluxio tier (the stand-in), fast and then slow.

    --num-workers 0 --prefetch 0: each rank fetches in its own process, one shard at a time, so
    every delay shows as data wait (and the fast run pays no worker start-up before its first
    batch). --hidden 1024 gives the ranks enough compute that the fast run stays well inside
    BUDGET (observed 0.10-0.16), while the slow one waits most of the time (observed ~0.8).
    """
    folder = plan.parent / "split" / EU
    ufs = "s3://geoshard-standin/train"
    with AlluxioWorkerStandIn(folder, ufs) as worker:
        tiers = plan.read_text().replace(
            f'local = "{folder}"', f'alluxio = "{worker.url}"\nbucket = "{ufs}"\nendpoint = "http://127.0.0.1:{closed_port()}"'
        )
        assert tiers != plan.read_text()
        alluxio_plan = tmp_path / "plan.toml"
        alluxio_plan.write_text(tiers)
        flags = ("--steps", 24, "--hidden", 1024, "--num-workers", 0, "--prefetch", 0, "--budget", BUDGET)
        fast, slow = tmp_path / "fast", tmp_path / "slow"
        train(alluxio_plan, fast, *flags)
        worker.delay_s = DELAY_S
        train(alluxio_plan, slow, *flags)
        assert worker.counts["page"] > 0

    f, s = report_of(fast), report_of(slow)
    for r in (f, s):
        assert list(r["tiers"]) == ["alluxio:eu-west-1"], r["tiers"]  # nothing fell back to another tier
    assert f["tiers"]["alluxio:eu-west-1"]["fetch_seconds_mean"] < DELAY_S / 2
    assert s["tiers"]["alluxio:eu-west-1"]["fetch_seconds_mean"] >= DELAY_S
    assert s["time_to_first_batch_s"] >= DELAY_S  # the first batch needed at least one slow fetch
    assert f["within_budget"] and f["verdict"] == "within budget" and f["io_wait_share"] <= BUDGET
    assert not s["within_budget"] and s["verdict"] == "over budget" and s["io_wait_share"] > BUDGET
    assert s["breakdown"]["data_wait"]["seconds"] > f["breakdown"]["data_wait"]["seconds"] + 1.0

    runner = CliRunner()
    over = runner.invoke(main, ["report", str(slow), "--fail-over-budget"])
    assert over.exit_code == 1 and "over budget" in over.output, over.output
    # Without --budget, the run's own budget (the trainer's --budget) is the measure.
    assert "over the 40.0% budget (--fail-over-budget)" in over.stderr
    over = runner.invoke(main, ["report", str(slow), "--budget", str(BUDGET), "--fail-over-budget"])
    assert over.exit_code == 1, over.output
    within = runner.invoke(main, ["report", str(fast), "--budget", str(BUDGET), "--fail-over-budget"])
    assert within.exit_code == 0 and "within budget" in within.output, within.output


def test_a_ranks_stdout_lines_are_one_write_each_under_torchruns_unbuffered_python() -> None:
    """torchrun runs ranks as ``python -u``: print's text and newline were two writes, and two ranks'
    start lines ran together on the stdout they share (CI, 12-07). The trainer's entry point makes
    each line one write."""
    code = (
        "import sys\n"
        "from geoshard.trainer.__main__ import one_write_per_line\n"
        "before = sys.stdout.write_through\n"
        "one_write_per_line()\n"
        "print('geoshard.trainer: a start line', flush=True)\n"
        "print(before, sys.stdout.write_through, sys.stdout.line_buffering)\n"
    )
    argv = [sys.executable, "-u", "-P", "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["geoshard.trainer: a start line", "True False True"]
    strace = shutil.which("strace")
    if strace is None:
        return
    traced = subprocess.run([strace, "-f", "-e", "trace=write", *argv], capture_output=True, text=True, timeout=60, check=False)
    # "[pid N] " leads each line where the process has threads (the imports start some)
    writes = [re.sub(r"^\[pid +\d+\] ", "", line) for line in traced.stderr.splitlines() if "write(1," in line]
    assert writes and writes[0].startswith('write(1, "geoshard.trainer: a start line\\n"'), writes


@pytest.mark.slow
def test_sigusr1_prints_every_ranks_and_workers_stacks_and_the_job_goes_on(plan: Path, tmp_path: Path) -> None:
    """A job that seems stuck: ``kill -USR1`` on its ranks and loader workers prints where each of
    their threads is (faulthandler), and training goes on to its end."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    steps = 40
    with launched(torchrun_argv(plan, out, "--steps", steps, "--num-workers", 1, "--step-time", 0.1), log, cwd=tmp_path) as proc:
        deadline = time.monotonic() + 120
        while last_step(out / "steps-rank0.jsonl") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        rank0 = rank_pid(proc.pid, 0)
        assert rank0 is not None
        signalled = rank_processes(proc.pid)  # docs/cli.md's pkill pattern, on this job's processes
        assert proc.pid not in signalled and rank0 in signalled, signalled  # the ranks, not torchrun's agent
        assert set(descendants(rank0)) & set(signalled), "rank 0's loader worker"
        for pid in signalled:  # one at a time, as docs/cli.md says: dumps at once mix their lines
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.3)
        code = proc.wait(timeout=240)
    text = log.read_text()
    assert code == 0, text[-5000:]
    assert last_step(out / "steps-rank0.jsonl") == steps
    dumps = [d for d in re.split(r"\n(?=Thread 0x|Current thread 0x)", text) if re.match(r"(Current t|T)hread 0x", d)]
    main_threads = [d for d in dumps if "in _loop" in d]  # the rank's training loop, in trainer/loop.py
    worker_threads = [d for d in dumps if "in _worker_loop" in d]  # torch's DataLoader worker
    assert main_threads and worker_threads, text[-5000:]
    assert all("trainer/__main__.py" in d for d in main_threads), main_threads[0]
