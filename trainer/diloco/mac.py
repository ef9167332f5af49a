"""A linear MAC over the all-reduced pseudo-gradients: gloo's connections are not authenticated,
so each owner checks the sum it received against values signed in the store.

Each contributing owner projects its (decoded) shard ``x_j`` onto ``K`` secret vectors ``v``
(standard normal, drawn in float32, applied in float64, from a ``torch.Generator`` seeded by an
HMAC of the job's secret, the round and its attempt, the shard and the vector: nobody without the
secret knows them) and
publishes, signed, ``p_j = <v, x_j>`` for each vector and ``b_j = |x_j|_2``. The projection is
linear, so the exact sum ``x`` has ``<v, x> = sum_j p_j``.

The bound. The received sum ``y`` was added in the compression's dtype, ``m - 1`` rounded
additions per element (unit roundoff ``u``: 2^-11 fp16, 2^-8 bf16, 2^-24 fp32), so the rounding
error ``e = y - x`` has ``|e_i| <= (m-1) u sum_j |x_ij|`` (to first order) and
``|e|_2 <= (m-1) u sum_j b_j``. ``e`` does not depend on the secret ``v``, so ``<v, e>`` is normal
with deviation ``|e|_2``: the check refuses when, for any vector,

    |<v, y> - sum_j p_j| > Z (m-1) u sum_j b_j,     Z = 10

which an honest sum does with probability below 2e-23 per vector (the float64 projections' own
error is below 2^-40 of the terms). A change ``d`` made to the sum on the wire passes one vector
with probability about ``0.8 tol / |d|_2`` when ``|d|_2`` is well above ``tol``, the ``K`` vectors
independently: with fp16 and 3 regions a change of 3% of the pseudo-gradient's norm is caught
with probability above 1 - 1e-4, a larger one more surely; a value that is not finite always.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from geoshard.trainer.diloco.auth import Refused, Signer
from geoshard.trainer.diloco.settings import SUMMABLE_DTYPES

K = 4
Z = 10.0
CHUNK = 1 << 22  # values per piece of a secret vector: memory stays bounded for any shard


def unit_roundoff(compression: str) -> float:
    return float(torch.finfo(SUMMABLE_DTYPES[compression]).eps) / 2


def _seed(signer: Signer, tag: str, s: int, i: int) -> int:
    return int(signer.mac(f"mac-vector/{tag}/{s}/{i}", b"")[:15], 16)


def project(signer: Signer, tag: str, s: int, x: torch.Tensor) -> list[float]:
    """``[p_1, ..., p_K, b]`` of shard ``s``'s values ``x`` (any float dtype).

    The K vectors are drawn in float32 (a third of float64's cost; products of float32 and any of
    the summable dtypes are exact in float64) and applied together, one matrix-vector product per
    piece in float64, each piece of ``x`` cast once."""
    flat = x.reshape(-1)
    gens = [torch.Generator().manual_seed(_seed(signer, tag, s, i)) for i in range(K)]
    acc = torch.zeros(K, dtype=torch.float64)
    for start in range(0, flat.numel(), CHUNK):
        # on the CPU whatever the shard's device: the vectors are drawn there (the same bits in
        # every region), and a CUDA shard met them as a device mismatch (seen on an H200 node)
        piece = flat[start : start + CHUNK].to("cpu", torch.float64)
        v = torch.stack([torch.randn(piece.numel(), generator=g, dtype=torch.float32) for g in gens])
        acc += torch.mv(v.double(), piece)
    return [*(float(p) for p in acc), float(flat.double().norm())]


def encode_projections(values: Sequence[float]) -> str:
    return " ".join(repr(float(v)) for v in values)


def decode_projections(text: bytes) -> list[float]:
    """A published ``[p_1..p_K, b]``; Refused when it is not ``K + 1`` finite numbers."""
    try:
        values = [float(f) for f in text.decode("ascii", errors="replace").split()]
    except ValueError:
        values = []
    if len(values) != K + 1 or not all(math.isfinite(v) for v in values) or values[-1] < 0:
        raise Refused("malformed", f"not {K + 1} finite projections")
    return values


def tolerance(published: Sequence[Sequence[float]], compression: str) -> float:
    return Z * (len(published) - 1) * unit_roundoff(compression) * sum(pub[K] for pub in published) + 1e-30


def check(signer: Signer, tag: str, s: int, summed: torch.Tensor, published: Sequence[Sequence[float]], compression: str) -> None:
    """Refused when ``summed`` is not finite or is not the sum the ``published`` projections describe."""
    bad = int((~torch.isfinite(summed)).sum())
    if bad:
        raise Refused("non-finite", f"{bad} of the sum's {summed.numel()} values are NaN or infinite")
    got = project(signer, tag, s, summed)
    tol = tolerance(published, compression)
    for i in range(K):
        want = sum(pub[i] for pub in published)
        if abs(got[i] - want) > tol:
            raise Refused(
                "unauthenticated", f"its projection {i} is {got[i]:.6g}, its contributors' add up to {want:.6g} (bound {tol:.3g})"
            )
