"""Launching the trainer under torchrun on this machine (what ``geoshard train`` and the demo do).

One region: one torchrun with ``--nproc-per-node N``. Several regions (``--regions
us-east-1:2,eu-west-1:1``): one torchrun agent per region, as a real job has one per node, each
with its region in GEOSHARD_REGION and its rank count, meeting at one c10d rendezvous. Under the
WAN rehearsal each agent runs inside its region's network namespace (``wrap``) and binds its
region's address, so every byte between regions crosses the rehearsal's links.

``--sync diloco``: each region is a torchrun job of its own (its own rendezvous, its own world),
and the region leaders meet in a store this process hosts (``trainer/diloco/``). A region that
fails does not stop the others; the launcher starts it again (``--max-restarts`` times, with
``--resume``), as a replacement node would be after a spot reclaim, and it rejoins the job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geoshard.errors import ConfigError
from geoshard.trainer.config import RegionRanks, TrainConfig
from geoshard.trainer.failures import StderrRelay, clear_failures, logs_dir, record_stop
from geoshard.util.procs import terminate

AGENT_TAG = "GEOSHARD_AGENT"  # marks a region's processes under --sync diloco (kill_tagged)
STOP_GRACE_S = 10.0  # after one agent fails, how long the others get to stop before SIGKILL


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_argv(
    cfg: TrainConfig,
    nproc: int,
    max_restarts: int = 0,
    master_port: int | None = None,
    *,
    nnodes: int = 1,
    host: str = "127.0.0.1",
    local_addr: str | None = None,
    is_host: bool | None = None,
    run_id: str = "none",
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        # c10d rendezvous, not the static master address: after a restart the static handler hands the
        # new ranks the old TCPStore, where they find the dead rank's gloo address (pytorch#135712).
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{host}:{master_port or free_port()}",
        "--rdzv-id",
        run_id,
    ]
    if local_addr is not None:
        argv += ["--local-addr", local_addr]
    if is_host is not None:  # which agent serves the rendezvous store (it cannot tell by address inside a namespace)
        argv += ["--rdzv-conf", f"is_host={int(is_host)}"]
    return [*argv, "-m", "geoshard.trainer", *cfg.to_argv()]


# On one machine the ranks' gloo and NCCL sockets listen on loopback (their default is the address
# the host name resolves to); --socket-ifname, or the rehearsal's interface, replaces these.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def _base_env(env: Mapping[str, str] | None) -> dict[str, str]:
    # PYTHONSAFEPATH: with geoshard installed from a wheel, `-m geoshard.trainer` started in a checkout
    # of this repository would import its geoshard/ folder, which has no trainer (an editable install
    # maps geoshard.trainer either way).
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: restarted ranks get a fresh store (see torchrun_argv).
    return {**os.environ, "PYTHONSAFEPATH": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}


def launch(cfg: TrainConfig, nproc: int, max_restarts: int = 0, env: Mapping[str, str] | None = None) -> int:
    """Run a one-region job to the end; torchrun's exit status. ``env`` adds variables for the ranks.

    stderr (torchrun's and the ranks') goes to RUN_DIR/logs/stderr.log, geoshard's warnings on to
    ours (``failures.StderrRelay``); a failed rank's one line is in RUN_DIR/logs/error-rank{R}.json."""
    # The rendezvous store lives here, on loopback only (an agent hosting it would listen on every address).
    store = _rendezvous_store("127.0.0.1")
    argv = torchrun_argv(cfg, nproc, max_restarts, store.port, local_addr="127.0.0.1", is_host=False)
    logs = _fresh_logs(cfg)
    # An argv list, no shell: nothing the user passes is interpreted.
    proc = subprocess.Popen(argv, env=_base_env({**LOOPBACK_ENV, **(env or {})}), stderr=subprocess.PIPE)  # noqa: S603
    assert proc.stderr is not None
    relay = StderrRelay(proc.stderr, logs / "stderr.log")
    code = proc.wait()
    relay.join()
    del store
    if code != 0:
        record_stop(cfg.out, "", code, relay)
    return code


def _fresh_logs(cfg: TrainConfig) -> Path:
    logs = logs_dir(cfg.out)
    logs.mkdir(parents=True, exist_ok=True)
    clear_failures(cfg.out)
    return logs


Wrap = Callable[[str, list[str]], list[str]]


@dataclass(frozen=True)
class RegionNet:
    """Where a region's agent lives: its address, and how to run a command there (identity: here)."""

    address: Callable[[str], str] = lambda region: "127.0.0.1"
    wrap: Wrap = lambda region, argv: argv
    env: Callable[[str], Mapping[str, str]] = lambda region: LOOPBACK_ENV
    # Runs a block with this thread in the region's network (sockets made there stay there).
    inside: Callable[[str], contextlib.AbstractContextManager[None]] = lambda region: contextlib.nullcontext()


def launch_regions(
    cfg: TrainConfig,
    regions: Sequence[RegionRanks],
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    net: RegionNet | None = None,
) -> int:
    """One torchrun agent per region, one rendezvous; the first failing agent's exit status, else 0."""
    if cfg.region is not None:
        raise ConfigError("--region names one region for the whole job; with --regions each region's ranks get their own")
    net = net or RegionNet()
    if cfg.sync == "diloco":
        return _launch_separate_regions(cfg, regions, max_restarts, env or {}, net)
    # Ranks numbered by the job's region order and their place in their region, not by the order
    # the agents met in (trainer/rankorder.py): one agent per region here.
    cfg = dataclasses.replace(cfg, rank_order=",".join(f"{r.region}:{r.nproc}" for r in regions))
    host = net.address(regions[0].region)
    # The rendezvous store lives in this process, which outlives every agent: an agent hosting it
    # would take it down while the others still send their last heartbeats.
    with net.inside(regions[0].region):
        store = _rendezvous_store(host)
    port = store.port
    run_id = f"geoshard-{os.getpid()}-{time.time_ns() % 10**9}"
    procs: list[subprocess.Popen[bytes]] = []
    relays: list[StderrRelay] = []
    logs, seen = _fresh_logs(cfg), set[bytes]()
    try:
        for r in regions:
            argv = torchrun_argv(
                cfg,
                r.nproc,
                max_restarts,
                port,
                nnodes=len(regions),
                host=host,
                local_addr=net.address(r.region),
                is_host=False,
                run_id=run_id,
            )
            agent_env = _base_env({**(env or {}), **net.env(r.region), "GEOSHARD_REGION": r.region})
            proc = subprocess.Popen(net.wrap(r.region, argv), env=agent_env, stderr=subprocess.PIPE)  # noqa: S603
            procs.append(proc)
            assert proc.stderr is not None
            relays.append(StderrRelay(proc.stderr, logs / "stderr.log", seen=seen))
        code, first = _wait_all(procs)
        if first is not None:
            relays[first].join(1.0)  # its last lines: torchrun's report of a rank's signal
            # The first agent to fail may have lost a peer that a signal killed in another region.
            for i in sorted(range(len(procs)), key=lambda i: i != first):
                if record_stop(cfg.out, f"region {regions[i].region}: ", procs[i].returncode, relays[i]):
                    break
        return code
    finally:
        terminate(procs, STOP_GRACE_S)
        for relay in relays:
            relay.join()
        del store


def _launch_separate_regions(
    cfg: TrainConfig, regions: Sequence[RegionRanks], max_restarts: int, env: Mapping[str, str], net: RegionNet
) -> int:
    """DiLoCo: one torchrun job per region; 0 when every region finished its steps, else the exit
    status of the first region that failed for good (the others still ran to their end)."""
    from geoshard.trainer.diloco import host_store
    from geoshard.trainer.diloco.auth import write_secret

    if cfg.resume:
        _check_region_checkpoints(cfg, regions)
    host = net.address(regions[0].region)
    with net.inside(regions[0].region):
        outer = host_store(host, timeout_s=max(300.0, cfg.outer_timeout))
    spec = ",".join(f"{r.region}:{r.nproc}" for r in regions)
    cfg.out.mkdir(parents=True, exist_ok=True)
    secret = write_secret(cfg.out)  # signs the store's values; the ranks get its path, never the secret
    job_cfg = dataclasses.replace(cfg, outer_store=f"{host}:{outer.port}", outer_regions=spec, outer_secret_file=str(secret))
    stores: dict[str, Any] = {}
    for r in regions:  # each region's rendezvous inside its own network: nothing of it crosses a link
        with net.inside(r.region):
            stores[r.region] = _rendezvous_store(net.address(r.region))
    jobs = _RegionJobs(job_cfg, max_restarts, env, net, stores, _fresh_logs(cfg))
    try:
        for r in regions:
            jobs.start(r)
        return jobs.supervise(regions)
    finally:
        jobs.stop()
        secret.unlink(missing_ok=True)  # it signs nothing once the store is gone
        del outer  # the stores go with this frame, after every region stopped


def _check_region_checkpoints(cfg: TrainConfig, regions: Sequence[RegionRanks]) -> None:
    """A whole DiLoCo job resumed: a region without checkpoints while others have theirs would start
    at step 0 and could publish its fresh weights as the job's outer state; refused before anything
    starts. No region with checkpoints: a fresh start, as ``--resume`` is on a first run."""
    from geoshard.trainer.checkpoint import CheckpointStore

    def empty(region: str) -> bool:
        target = cfg.region_checkpoint_target(region)
        return CheckpointStore(target, endpoint_url=cfg.checkpoint_endpoint, region=cfg.checkpoint_region).is_empty()

    missing = [r.region for r in regions if empty(r.region)]
    if missing and len(missing) < len(regions):
        have = [r.region for r in regions if r.region not in missing]
        raise ConfigError(
            f"--resume: no checkpoint for region {', '.join(missing)} under {cfg.checkpoint_target} "
            f"({', '.join(have)} {'has' if len(have) == 1 else 'have'} theirs); it would start at step 0 and "
            "could overwrite the others' outer state: restore its checkpoints, or start the job over with --overwrite"
        )


@dataclass
class _RegionJobs:
    """DiLoCo's regions as torchrun jobs of their own; a region that fails starts again (with
    ``--resume``) up to ``max_restarts`` times."""

    cfg: TrainConfig
    max_restarts: int
    env: Mapping[str, str]
    net: RegionNet
    stores: dict[str, Any]  # each region's rendezvous store
    logs: Path
    seen: set[bytes] = dataclasses.field(default_factory=set)
    relays: list[StderrRelay] = dataclasses.field(default_factory=list)
    relay_of: dict[str, int] = dataclasses.field(default_factory=dict)  # each region's current agent's relay
    running: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)
    starts: dict[str, int] = dataclasses.field(default_factory=dict)
    tags: dict[str, str] = dataclasses.field(default_factory=dict)

    def start(self, r: RegionRanks) -> None:
        n = self.starts.get(r.region, 0)
        region_cfg = self.cfg if n == 0 else dataclasses.replace(self.cfg, resume=True)
        address = self.net.address(r.region)
        argv = torchrun_argv(
            region_cfg,
            r.nproc,
            self.max_restarts,
            self.stores[r.region].port,
            host=address,
            local_addr=address,
            is_host=False,
            run_id=f"geoshard-{r.region}-{os.getpid()}-{n}",
        )
        self.tags[r.region] = f"{os.getpid()}-{time.time_ns()}-{r.region}"
        agent_env = _base_env({**self.env, **self.net.env(r.region), "GEOSHARD_REGION": r.region, AGENT_TAG: self.tags[r.region]})
        proc = subprocess.Popen(self.net.wrap(r.region, argv), env=agent_env, stderr=subprocess.PIPE)  # noqa: S603
        assert proc.stderr is not None
        self.relay_of[r.region] = len(self.relays)
        self.relays.append(StderrRelay(proc.stderr, self.logs / "stderr.log", seen=self.seen))
        self.running[r.region] = proc
        self.starts[r.region] = n + 1

    def supervise(self, regions: Sequence[RegionRanks]) -> int:
        """Until every region has ended for good: the first failing region's exit status, else 0."""
        code = 0
        while self.running:
            for r in regions:
                proc = self.running.get(r.region)
                if proc is None or proc.poll() is None:
                    continue
                del self.running[r.region]
                if proc.returncode == 0:
                    continue
                kill_tagged(self.tags[r.region])  # what is left of the region: ranks in their own sessions, loader workers
                if self.starts[r.region] <= self.max_restarts:
                    print(f"geoshard: region {r.region} stopped (exit {proc.returncode}); starting it again", file=sys.stderr, flush=True)
                    self.start(r)
                elif code == 0:
                    code = proc.returncode
                    relay = self.relays[self.relay_of[r.region]]
                    relay.join(1.0)  # its last lines: torchrun's report of a rank's signal
                    record_stop(self.cfg.out, f"region {r.region}: ", code, relay)
            time.sleep(0.1)
        return code

    def stop(self) -> None:
        terminate(list(self.running.values()), STOP_GRACE_S)
        for tag in self.tags.values():
            kill_tagged(tag)
        for relay in self.relays:
            relay.join()


def kill_tagged(tag: str) -> int:
    """SIGKILL every process started with ``AGENT_TAG=tag`` in its environment: a region's agent
    and what it started (torchrun puts each rank in a session of its own, so no process group
    holds them all). The number killed."""
    want = f"\0{AGENT_TAG}={tag}\0".encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if want in b"\0" + (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


def _rendezvous_store(host: str) -> Any:
    from geoshard.trainer.listen import master_store

    return master_store(host, timeout_s=900, multi_tenant=True)


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> tuple[int, int | None]:
    """Until every agent ends; once one fails, the rest get STOP_GRACE_S (their peers are gone).
    The first failing agent's exit status and index (0 and None: every agent succeeded)."""
    failed_at: float | None = None
    code, first = 0, None
    while True:
        running = [p for p in procs if p.poll() is None]
        for i, p in enumerate(procs):
            if p.returncode not in (None, 0) and code == 0:
                code, first, failed_at = p.returncode, i, time.monotonic()
        if not running:
            return code, first
        if failed_at is not None and time.monotonic() - failed_at > STOP_GRACE_S:
            return code, first
        time.sleep(0.1)
