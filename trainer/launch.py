"""Launching the trainer under torchrun on this node (what ``geoshard train`` and the demo do)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping

from geoshard.trainer.config import TrainConfig


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_argv(cfg: TrainConfig, nproc: int, max_restarts: int = 0, master_port: int | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        # c10d rendezvous, not the static master address: after a restart the static handler hands the
        # new ranks the old TCPStore, where they find the dead rank's gloo address (pytorch#135712).
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{master_port or free_port()}",
        "-m",
        "geoshard.trainer",
        *cfg.to_argv(),
    ]


def launch(cfg: TrainConfig, nproc: int, max_restarts: int = 0, env: Mapping[str, str] | None = None) -> int:
    """Run the job to the end; torchrun's exit status. ``env`` adds variables for the ranks."""
    argv = torchrun_argv(cfg, nproc, max_restarts)
    # PYTHONSAFEPATH: `-m geoshard.trainer` must import the installed package, not a geoshard/
    # source folder that happens to be in the current directory (a checkout of this repository).
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: restarted ranks get a fresh store (see torchrun_argv).
    full_env = {**os.environ, "PYTHONSAFEPATH": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    # An argv list, no shell: nothing the user passes is interpreted.
    return subprocess.run(argv, env=full_env, check=False).returncode  # noqa: S603
