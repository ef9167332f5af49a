"""The outer state that travels by broadcast, authenticated: round 0's parameters and a rejoining
region's parameters and momentum. gloo's connections are not authenticated, so before it sends,
each owner of the source region publishes, signed in the store, an HMAC (the job's secret) of
every piece it broadcasts; each receiver checks the bytes that arrived against it before using
them. A broadcast is a copy, not a sum, so the check is exact: unlike the MAC of the sums
(``mac``), no rounding tolerance is needed, and any change of any bit is refused (HMAC-SHA256: a
forger without the secret succeeds with probability 2^-256 a piece). The cost is one pass of
SHA-256 over the bytes sent and one over those received, once a join or rejoin (measured 0.13-0.34
GB/s on one busy core of the build machine: 12-30 s for the 4 GB of a 10^9-parameter model in a
one-rank region, a projection; docs/diloco.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.kv import KV


def _view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in place (a copy only when it is not a contiguous CPU tensor)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def publish(kv: KV, key: str, pieces: Sequence[torch.Tensor]) -> None:
    """Signed under ``key``: the HMAC of each piece, in the order they are sent."""
    kv.set(key, " ".join(kv.signer.mac(f"{key}/{i}", _view(t)) for i, t in enumerate(pieces)))


def check(kv: KV, key: str, pieces: Sequence[torch.Tensor], timeout_s: float) -> str:
    """'' when every piece that arrived matches the source's signed HMAC; else why not (a refusal
    counted by the signer)."""
    if not kv.wait_all([key], timeout_s):
        return f"the source's signed digests ({key}) did not arrive within {timeout_s:g} s"
    (value,) = kv.open_many([key])  # it exists: one round trip, not get's check and get
    if value is None:
        return f"{key} is not signed by the job"
    macs = value.decode("ascii", errors="replace").split()
    if len(macs) != len(pieces):
        kv.signer.refuse(key, Refused("malformed", f"{len(macs)} digests for {len(pieces)} pieces"), value, log_it=False)
        return f"{key} holds {len(macs)} digests for the {len(pieces)} pieces sent"
    for i, (mac, t) in enumerate(zip(macs, pieces, strict=True)):
        try:
            kv.signer.check_mac(f"{key}/{i}", _view(t), mac)
        except Refused as e:
            kv.signer.refuse(f"{key}/{i}", e, log_it=False)
            return f"piece {i} of {key}: the bytes that arrived do not match the source's signed digest"
    return ""


def check_all(kv: KV, sent: Sequence[tuple[str, Sequence[torch.Tensor]]], timeout_s: float) -> str:
    """``check`` of each (key, pieces) in turn: the first reason to refuse, or ''."""
    for key, pieces in sent:
        why = check(kv, key, pieces, timeout_s)
        if why:
            return why
    return ""
