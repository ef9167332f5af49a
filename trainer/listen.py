"""Stores that listen only where they are asked (issue 20: ports open where asked, nowhere else).

A ``torch.distributed.TCPStore`` server listens on every address whatever host it is given. Handed
a socket already bound to (host, port) and listening (``master_listen_fd``), it serves that socket
alone. Every store geoshard hosts is made here: the launcher's rendezvous and outer stores, and
rank 0's process-group store, which ``process_group_store`` builds in place of torchrun's
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` would have rank 0 host it on every address).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Mapping

import torch.distributed as dist

from geoshard.errors import ConfigError

BACKLOG = 128


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host`` (an address or a name resolving to one) and listening."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {host}: the name does not resolve ({e.strerror})") from e
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; name an address of this machine") from e
    return sock


def master_store(
    host: str,
    port: int = 0,
    *,
    timeout_s: float,
    world_size: int | None = None,
    wait_for_workers: bool = False,
    multi_tenant: bool = False,
) -> dist.TCPStore:
    """A TCPStore server on ``host:port`` only (port 0: a free one; ``.port`` is the one it got)."""
    sock = listening_socket(host, port)
    bound = int(sock.getsockname()[1])
    return dist.TCPStore(
        host,
        bound,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=wait_for_workers,
        multi_tenant=multi_tenant,
        master_listen_fd=sock.detach(),
    )


def process_group_store(environ: Mapping[str, str], timeout_s: float) -> tuple[dist.TCPStore, int, int]:
    """The process group's store from torchrun's variables, with the rank and world size: rank 0
    serves it on MASTER_ADDR:MASTER_PORT (the address its peers reach it at, and only there), the
    others connect to it. Where torchrun shares its agent's store (TORCHELASTIC_USE_AGENT_STORE,
    torch's own rule in ``_create_c10d_store``), the agent serves it and every rank connects."""
    try:
        host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"run the trainer under torchrun: {e} is missing or not a number in its environment") from e
    if rank == 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return master_store(host, port, timeout_s=timeout_s, world_size=world), rank, world
    store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return store, rank, world
