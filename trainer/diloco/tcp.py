"""The host's TCP setting the peer-to-peer exchange depends on (docs/diloco.md, "the hosts' TCP").

Measured under the rehearsal at a 1,500-byte MTU and 100 ms drop-tail buffers: the trainer's
exchange took 1.41-2.12x the ring's bound with cubic and 1.17-1.20x with BBR, whose pacing does
not read each drop as congestion. The setting is per network namespace, so a rank reads its own.
"""

from __future__ import annotations

import re
from pathlib import Path

CONGESTION_CONTROL = Path("/proc/sys/net/ipv4/tcp_congestion_control")
PACED = frozenset({"bbr", "bbr2", "bbr3"})
_NAME = re.compile(r"[a-z][a-z0-9_]{0,15}")  # a kernel module's name; anything else is not read as one


def congestion_advice(path: Path = CONGESTION_CONTROL) -> str | None:
    """One line for the log when the host's congestion control is not BBR, else None (BBR, or no
    such file: not Linux, or /proc not mounted)."""
    try:
        name = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    if name in PACED or not _NAME.fullmatch(name):
        return None
    return (
        f"this host's TCP congestion control is {name} (net.ipv4.tcp_congestion_control): the outer exchange "
        "across regions measured about 1.3x slower with it than with bbr on long links (docs/diloco.md); "
        "set net.ipv4.tcp_congestion_control=bbr on the hosts that exchange"
    )
