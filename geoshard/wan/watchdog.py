"""Removes a rehearsal's namespaces when its owner stops or dies, even by SIGKILL.

``python -m geoshard.wan.watchdog OWNER_PID NAME...`` runs in its own session (a Ctrl-C or a
signal to the owner's process group does not reach it). It waits on a pidfd of the owner and on
its stdin: a line or end of input from the owner means a normal stop, the pidfd turning readable
means the owner died. Either way it kills what still runs inside the namespaces and removes them
(idempotent: the owner may have done it already), then exits. The forwarder watches the owner on
its own, so the TUN devices vanish with it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys

from geoshard.wan import netns


def main(argv: list[str]) -> int:
    owner, names = int(argv[0]), argv[1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError):
        pidfd = os.pidfd_open(owner)
        sys.stdout.write("watching\n")
        sys.stdout.flush()
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
        poller.poll()
    for name in names:
        with contextlib.suppress(Exception):  # best effort: one stuck name must not keep the others
            netns.delete_namespace(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
