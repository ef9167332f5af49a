"""A linear MAC over the all-reduced pseudo-gradients: gloo's connections are not authenticated,
so each owner checks the sum it received against values signed in the store.

The vectors. Each value ``i`` of shard ``s`` gets a secret ``K``-bit code ``c_i`` (``K = 15``):
16-bit lanes of 64-bit words, the XOR of two ``torch.Generator`` streams (mt19937, on the CPU
whatever the shard's device: the same bits in every region), each seeded with 32 bits of an HMAC
of the job's secret, the round and its attempt, and the shard (a CPU generator keeps only 32 bits
of its seed, hence two: 64 secret bits; nobody without the job's secret knows the codes). Bit
``k`` of ``c_i`` is the sign of vector ``k`` at ``i`` (Rademacher, +-1). Each contributing owner
publishes, signed, ``p_j = <v, x_j>`` for each vector and ``b_j = |x_j|_2``; the projection is
linear, so the exact sum ``x`` has ``<v, x> = sum_j p_j``. One pass computes all ``K``
projections: the values are added into ``2^K`` buckets by code (float64, a cached block at a
time), and projection ``k`` is the signed sum of the buckets; the cost does not grow with ``K``.
The codes drawn for a shard's publish are kept (2 bytes a value, up to ``KEEP_BYTES``) for the
check of the same shard, which then draws nothing. The check may be fed the sum a piece at a time,
in order, as its waves land (``Projector``): each value meets the same code and bucket as in one
pass, so the projections, the tolerance and the guarantee below are those of one pass.

The bound. The received sum ``y`` was added in the compression's dtype, ``m - 1`` rounded
additions per element (unit roundoff ``u``: 2^-11 fp16, 2^-8 bf16, 2^-24 fp32), so the rounding
error ``e = y - x`` has ``|e|_2 <= (m-1) u sum_j b_j`` (to first order). ``e`` does not depend on
the secret signs, so by Hoeffding ``P(|<v, e>| > t) <= 2 exp(-t^2 / (2 |e|_2^2))``. The check
refuses when, for any vector,

    |<v, y> - sum_j p_j| > tol = Z (m-1) u sum_j b_j + F,     Z = 10

(``F`` bounds the float64 projections' own rounding, ``(2n / 2^K + 80 + 2^K) 2^-52 sqrt(n)
(sum_j b_j + |y|_2)`` for a shard of ``n`` values: below 2^-23 of the norms up to 2^26 values,
against fp16's 2^-10; no bucket gets more than ``2n / 2^K + 80`` values but with probability
below 7e-21, by Chernoff): an honest sum fails it with probability below ``2 e^-50 = 3.9e-22``
per vector, ``5.8e-21`` for the 15, 1.3e-20 with the buckets' bound.

A change ``d`` made on the wire (``y = x + e + d``) passes a vector only if ``|<v, e + d>| <=
tol``. If some coordinate has ``|e_i + d_i| > tol``, flipping that sign moves the projection by
more than ``2 tol``, so at most one of the ``2^K`` equally likely sign patterns at ``i`` passes all
``K`` vectors: missed with probability at most ``2^-15 = 3.1e-5``, whatever the change's shape
(sparse, paired, structured). If every coordinate is below ``tol``, ``<v, d>`` is close to normal
with deviation ``|d|_2`` (Berry-Esseen): a vector passes with probability at most about ``2 tol /
|d|_2``, so a change of norm ``4 tol`` or more is missed with probability at most about ``2^-15``,
a larger one less. A value that is not finite is refused always. The guarantee rests on the
generator's bits looking independent to whoever lacks the seeds, as before (mt19937 is not a
cryptographic generator; the seeds change every round, attempt and shard).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence

import torch

from geoshard.trainer.diloco.auth import Refused, Signer
from geoshard.trainer.diloco.settings import SUMMABLE_DTYPES

K = 15
Z = 10.0
CHUNK = 1 << 22  # values per piece (a multiple of 4: four 16-bit codes a word): memory stays bounded
BLOCK = 1 << 19  # values cast to float64 at a time (4 MB: 1 << 17, 19 and 22 measured 0.092, 0.066, 0.073 s per 11M)
KEEP_BYTES = 512 << 20  # codes kept between a shard's publish and its check, at most (2 bytes a value)
_MASK = (1 << K) - 1


def unit_roundoff(compression: str) -> float:
    return float(torch.finfo(SUMMABLE_DTYPES[compression]).eps) / 2


def _seeds(signer: Signer, tag: str, s: int) -> tuple[int, int]:
    h = signer.mac(f"mac-codes/{tag}/{s}", b"")
    return int(h[:8], 16), int(h[8:16], 16)


def _draw(seeds: tuple[int, int], numel: int, device: torch.device) -> Iterator[torch.Tensor]:
    """Each piece's codes (int16 in [0, 2^K), on ``device``), in order; the same bits on any device."""
    g1, g2 = (torch.Generator().manual_seed(x) for x in seeds)
    for start in range(0, numel, CHUNK):
        n = min(CHUNK, numel - start)
        words = torch.empty(-(-n // 4), dtype=torch.int64).random_(generator=g1)
        words ^= torch.empty_like(words).random_(generator=g2)
        yield words.to(device).view(torch.int16)[:n] & _MASK


class _Kept:
    """Codes drawn for a publish, kept for the check of the same shard (up to ``KEEP_BYTES`` in
    all; above, the check draws them again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._codes: dict[tuple[tuple[int, int], int, str], list[torch.Tensor]] = {}

    def take(self, key: tuple[tuple[int, int], int, str]) -> list[torch.Tensor] | None:
        with self._lock:
            return self._codes.pop(key, None)

    def put(self, key: tuple[tuple[int, int], int, str], codes: list[torch.Tensor]) -> None:
        size = sum(c.numel() * 2 for c in codes)
        if size > KEEP_BYTES:
            return
        with self._lock:
            held = sum(c.numel() * 2 for cs in self._codes.values() for c in cs)
            while self._codes and held + size > KEEP_BYTES:  # oldest first: a round that failed before its check
                old = self._codes.pop(next(iter(self._codes)))
                held -= sum(c.numel() * 2 for c in old)
            self._codes[key] = codes

    def __len__(self) -> int:
        return len(self._codes)


KEPT = _Kept()


def _signs(device: torch.device) -> torch.Tensor:
    """``2^K x K``: row ``c`` holds the K vectors' signs for code ``c`` (+1 for bit 0, -1 for bit 1)."""
    c = torch.arange(1 << K, dtype=torch.int64, device=device).unsqueeze(1)
    bits = (c >> torch.arange(K, dtype=torch.int64, device=device)) & 1
    return (1 - 2 * bits).to(torch.float64)


class Projector:
    """``project`` fed a piece at a time, in order: the buckets are sums, so the pieces of a shard's
    sum can be added as they arrive (the p2p exchange's waves) and only the last piece's pass is
    left once the transfer ends. Every value meets the same code and is added once to the same
    bucket as in one ``project``: the same projections (up to float64 order, which ``float_error``
    bounds), the same guarantee. Takes the codes a publish of the same shard and size kept."""

    def __init__(self, signer: Signer, tag: str, s: int, numel: int, device: torch.device, *, keep: bool = False) -> None:
        seeds = _seeds(signer, tag, s)
        self._key = (seeds, numel, str(device))
        kept = KEPT.take(self._key)
        self._codes = iter(kept) if kept is not None else _draw(seeds, numel, device)
        self._keep = keep and kept is None and numel * 2 <= KEEP_BYTES  # past the bound they would not be kept anyway
        self._used: list[torch.Tensor] = []
        self._cur = torch.empty(0, dtype=torch.int16, device=device)
        self._pos, self.done, self.numel = 0, 0, numel
        self._buckets = torch.zeros(1 << K, dtype=torch.float64, device=device)
        self._square = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        """The shard's next ``x.numel()`` values."""
        flat = x.reshape(-1)
        if self.done + flat.numel() > self.numel:
            raise ValueError(f"{self.done + flat.numel()} values fed to a projection of {self.numel}")
        i = 0
        while i < flat.numel():
            if self._pos == self._cur.numel():
                self._cur, self._pos = next(self._codes), 0
                if self._keep:
                    self._used.append(self._cur)
            n = min(flat.numel() - i, self._cur.numel() - self._pos)
            codes = self._cur[self._pos : self._pos + n]
            for a in range(0, n, BLOCK):  # cast a block at a time: it stays in the cache for both uses
                block = flat[i + a : i + min(a + BLOCK, n)].to(torch.float64)
                self._buckets.index_add_(0, codes[a : a + BLOCK].to(torch.int32), block)
                self._square += torch.dot(block, block)
            i, self._pos = i + n, self._pos + n
        self.done += flat.numel()

    def result(self) -> list[float]:
        """``[p_1, ..., p_K, b]`` once every value was fed."""
        if self.done != self.numel:
            raise ValueError(f"a projection of {self.numel} values was fed {self.done}")
        if self._keep:
            KEPT.put(self._key, self._used)
        projections = _signs(self._buckets.device).T @ self._buckets
        return [*(float(p) for p in projections.cpu()), math.sqrt(float(self._square))]


def project(signer: Signer, tag: str, s: int, x: torch.Tensor, *, keep: bool = False) -> list[float]:
    """``[p_1, ..., p_K, b]`` of shard ``s``'s values ``x`` (any float dtype, any device).

    ``keep``: hold the codes for the next ``project`` of the same shard and size (the check after
    a publish), within ``KEEP_BYTES``; a call that finds them kept uses them and drops them."""
    flat = x.reshape(-1)
    p = Projector(signer, tag, s, flat.numel(), flat.device, keep=keep)
    p.add(flat)
    return p.result()


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


def float_error(numel: int, norms: float) -> float:
    """A bound on the float64 projections' own rounding for a shard of ``numel`` values whose
    norms add up to ``norms``: each bucket adds at most ``2 numel / 2^K + 80`` values (but with
    probability below 7e-21), each projection ``2^K`` buckets, and |x|_1 <= sqrt(numel) |x|_2."""
    return (2 * numel / (1 << K) + 80 + (1 << K)) * 2.0**-52 * math.sqrt(numel) * norms


def tolerance(published: Sequence[Sequence[float]], compression: str, numel: int = 0, received: float = 0.0) -> float:
    norms = sum(pub[K] for pub in published)
    rounding = Z * (len(published) - 1) * unit_roundoff(compression) * norms
    return rounding + float_error(numel, norms + received) + 1e-30


def check(signer: Signer, tag: str, s: int, summed: torch.Tensor, published: Sequence[Sequence[float]], compression: str) -> None:
    """Refused when ``summed`` is not finite or is not the sum the ``published`` projections describe."""
    check_projected(project(signer, tag, s, summed), summed, published, compression)


def check_projected(got: Sequence[float], summed: torch.Tensor, published: Sequence[Sequence[float]], compression: str) -> None:
    """``check`` of a sum whose projections ``got`` were computed already (a ``Projector`` fed its
    pieces as they arrived)."""
    if not math.isfinite(got[K]):  # a sum of squares is not finite exactly when a value is not: no pass of its own
        bad = int((~torch.isfinite(summed)).sum())
        raise Refused("non-finite", f"{bad} of the sum's {summed.numel()} values are NaN or infinite")
    tol = tolerance(published, compression, summed.numel(), got[K])
    for i in range(K):
        want = sum(pub[i] for pub in published)
        if abs(got[i] - want) > tol:
            raise Refused(
                "unauthenticated", f"its projection {i} is {got[i]:.6g}, its contributors' add up to {want:.6g} (bound {tol:.3g})"
            )
