"""int8 / fp8 pseudo-gradients over the peer-to-peer transport: a reduce-scatter, then an
all-gather, in the codec's bytes (INTELLECT-1's scheme), on the shards' groups (``sharded``).

Blocks with their own scales cannot be summed by an all-reduce, so for each owned shard and
stream chunk, among the member regions' owners of that shard (ring order, ``m`` members):

1. each owner adds its error feedback residual (kept per owned shard here, checkpointed), cuts the
   chunk into ``m`` parts (``parts``), encodes each, and sends part ``j`` to member ``j`` (gloo
   ``alltoall_base``); the residual becomes what the encodings dropped;
2. member ``j`` decodes the ``m`` encodings of its part and sums them in fp32 in member order,
   starting from zero (the same bits whichever member computes it), then encodes the sum once
   (no feedback for that second rounding: for int8 at most absmax/254 of the sum's block per value,
   fp8 |x|/16 + absmax * 2**-19);
3. every member sends its encoded sum to the others (``alltoall_base`` again) and decodes all of
   them: every member holds the same sum.

Each owner sends 2(m-1)/m of its chunk's encoded size, a byte a value plus 4 per block of 1024:
about half of fp16's all-reduce at any m. Every piece that crosses a region is known to its sender
before it goes, so the sender signs its HMAC digests in the store (keys ``q1``/``q2``), publishing
them while the bytes travel; the receiver checks the bytes exactly against them, then lets the
codec check sizes and scales, before any use. A piece that fails makes its receiver send an
unusable sum (NaN scales, ``codec.unusable``) in step 3, so every member refuses the chunk alike:
the region keeps its own parameters for that round (p2p's REFUSED path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from geoshard.trainer.diloco.auth import Refused
from geoshard.trainer.diloco.codec import Codec, ErrorFeedback, NonFinite, unusable
from geoshard.trainer.diloco.groups import LOOPBACK, Bind, GroupCache, gloo_group
from geoshard.trainer.diloco.kv import KV
from geoshard.trainer.diloco.pipeline import one_thread
from geoshard.trainer.diloco.sharded import DEFAULT_STREAMS, ShardGroups, gather_in_region, make_groups
from geoshard.trainer.diloco.sharded import Membership as Ring
from geoshard.trainer.diloco.shards import Layout, shard_count

if TYPE_CHECKING:
    from geoshard.trainer.diloco.membership import Decision
    from geoshard.trainer.diloco.p2p import P2PExchange

log = logging.getLogger(__name__)

# per owned shard, per stream chunk: its group, its size, its members' parts ([a, b) in the chunk), their payloads
Chunks = dict[int, list[tuple[Any, int, list[tuple[int, int]], list[bytes]]]]


def parts(n: int, m: int) -> list[tuple[int, int]]:
    """[0, n) in exactly ``m`` near-equal parts (some empty when n < m): part j goes to member j."""
    base, extra = divmod(n, m)
    out, start = [], 0
    for j in range(m):
        stop = start + base + (1 if j < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.numpy().tobytes())


def _tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)


def _decode(c: Codec, payload: bytes, n: int) -> torch.Tensor:
    """``c.decode``, and an empty part (a chunk of fewer values than members) as no values: the
    codec cannot view an empty buffer; its size is checked all the same."""
    if n == 0:
        if payload:
            raise Refused("malformed", f"{len(payload)} bytes for an empty part")
        return torch.zeros(0, dtype=torch.float32)
    return c.decode(payload, n)


@dataclass(frozen=True)
class Where:
    """One exchange's place: the round, attempt, membership name, this member's index, the members."""

    r: int
    attempt: int
    name: str
    me: int
    members: tuple[str, ...]


class Quantized:
    """One rank's side of the quantized exchange: its codec, and each owned shard's residual."""

    def __init__(self, c: Codec, kv: KV, feedback: bool, timeout_s: float) -> None:
        self.codec, self.kv, self.timeout_s = c, kv, timeout_s
        self.feedback = feedback
        self.residual: dict[int, torch.Tensor] = {}  # per owned shard, from its first round
        self._start: tuple[int, dict[int, torch.Tensor]] = (-1, {})  # the round in flight, its residual before its first attempt
        self.published: dict[int, list[str]] = {}  # per round, the digest keys this rank set (deleted two rounds on)

    # -- error feedback ------------------------------------------------------------------------
    def begin(self, r: int) -> None:
        """Before each attempt of round ``r``: a redo (an attempt that failed: its encodings never
        arrived) encodes from the residual the round started with. The failed attempt's residual
        is the rounding of values nobody received: from it the redo would lose the carried residual."""
        if self._start[0] == r:
            self.residual = dict(self._start[1])  # encode_shard replaces a shard's tensor, never changes it
        else:
            self._start = (r, dict(self.residual))

    def end(self) -> None:
        """The round is over (taken, refused or given up): the residual it started with is let go,
        so between rounds a rank holds one residual (4 bytes an owned value), not two."""
        self._start = (-1, {})

    def encode_shard(self, s: int, delta: torch.Tensor, cuts: Sequence[Sequence[tuple[int, int]]], fresh: bool) -> list[list[bytes]]:
        """Shard ``s``'s pseudo-gradient (plus its residual) encoded per chunk and part (``cuts``:
        per chunk, its parts' [a, b) within the shard); the residual becomes what they dropped. A
        region that rejoined sends zeros and keeps its residual. ``NonFinite`` leaves it unchanged."""
        x = delta.detach().reshape(-1).float()
        if self.feedback and not fresh and s in self.residual:
            x = x + self.residual[s]
        if not (self.feedback and not fresh):
            return [[self.codec.encode(x[a:b]) for a, b in chunk] for chunk in cuts]
        out, sent = [], torch.empty_like(x)
        for chunk in cuts:
            payloads = []
            for a, b in chunk:
                payload, back = self.codec.roundtrip(x[a:b])
                sent[a:b] = back
                payloads.append(payload)
            out.append(payloads)
        self.residual[s] = x - sent
        return out

    def state(self, spans: dict[int, tuple[int, int]], numel: int) -> torch.Tensor:
        """The owned shards' residuals in a full-length vector (zeros elsewhere), to be summed over the region."""
        full = torch.zeros(numel, dtype=torch.float32)
        for s, t in list(self.residual.items()):  # a round in flight may replace one meanwhile
            a, b = spans[s]
            full[a:b] = t
        return full

    def load(self, full: ErrorFeedback, spans: dict[int, tuple[int, int]]) -> None:
        """The owned shards of a checked full residual (``ErrorFeedback.load_state_dict``)."""
        self.residual = {} if full.residual is None else {s: full.residual[a:b].clone() for s, (a, b) in spans.items()}

    def prepare(self, groups: ShardGroups, deltas: dict[int, torch.Tensor], m: int, fresh: bool = False) -> tuple[Chunks, list[str]]:
        """Each owned shard's pseudo-gradient encoded per stream chunk (``groups.pieces``) and per
        member's part, with its group: ``exchange``'s input; and why any shard was not finite (it
        goes out unusable, NaN scales, so the others refuse it at once)."""
        chunks: Chunks = {}
        bad = []
        for s, delta in deltas.items():
            pieces = groups.pieces(s)
            cuts = [[(ca + x, ca + y) for x, y in parts(cb - ca, m)] for ca, cb in pieces]
            try:
                payloads = self.encode_shard(s, torch.zeros_like(delta) if fresh else delta, cuts, fresh)
            except NonFinite as e:
                bad.append(f"shard {s}: {e}")
                payloads = [[unusable(self.codec, y - x) for x, y in cut] for cut in cuts]
            chunks[s] = [
                (groups.group(s, c) if m > 1 else None, cb - ca, [(x - ca, y - ca) for x, y in cut], p)
                for c, ((ca, cb), cut, p) in enumerate(zip(pieces, cuts, payloads, strict=True))
            ]
        return chunks, bad

    # -- the exchange ----------------------------------------------------------------------------
    def key(self, w: Where, step: str, s: int, region: str) -> str:
        """Where ``region``'s owner of shard ``s`` signs the digests of what it sends in ``step``."""
        return self.kv.key("r", w.r, w.attempt, step, w.name, s, region)

    def exchange(
        self,
        w: Where,
        chunks: Chunks,
        corrupt: Callable[[int, torch.Tensor], None] | None = None,
    ) -> tuple[dict[int, list[torch.Tensor]], int, str]:
        """``chunks``: per owned shard, per chunk (its group, its size, its parts, their payloads).
        Per shard and chunk, the decoded sum (fp32); the bytes this rank sent; why a piece was
        refused ('' if none). Collective over the members' owners; every chunk at once."""
        m = len(w.members)
        for old in [r for r in self.published if r <= w.r - 2]:  # every member read them before round r - 1 ended
            self.kv.delete(self.published.pop(old), [])
        if m == 1:  # alone: its own values, rounded once
            return {s: [self._decode_whole(p, cut) for _, _, cut, p in cs] for s, cs in chunks.items()}, 0, ""
        sent, why = 0, ""
        first = []
        for s in sorted(chunks):
            for c, (group, _, cut, payloads) in enumerate(chunks[s]):
                ins = [0 if j == w.me else len(p) for j, p in enumerate(payloads)]
                buf = _tensor(b"".join(p for j, p in enumerate(payloads) if j != w.me))
                if corrupt is not None:
                    corrupt(s, buf)  # tests: a change on the wire, after the digests were taken
                a, b = cut[w.me]
                outs = [0 if i == w.me else self.codec.nbytes(b - a) for i in range(m)]
                got = torch.empty(sum(outs), dtype=torch.uint8)
                first.append((s, c, got, outs, group.alltoall_base(got, buf, outs, ins)))
                sent += buf.numel()
        for s in sorted(chunks):  # the digests, signed, while the bytes travel: piece c * m + j goes to member j
            self._publish(w, "q1", s, [b"" if j == w.me else p for *_, payloads in chunks[s] for j, p in enumerate(payloads)])
        second, digests = [], None
        sums: dict[int, list[bytes]] = {}
        for s, c, got, outs, work in first:
            work.wait()
            if digests is None:  # published before the bytes arrived: one read for every chunk
                digests = self._fetch(w, "q1", chunks)
            group, _, cut, payloads = chunks[s][c]
            total, problem = self._reduce(w, s, c, digests, got, outs, payloads[w.me], cut[w.me])
            why = why or problem
            mine = self._sum_payload(total, cut[w.me])
            sums.setdefault(s, []).append(mine)
            if len(sums[s]) == len(chunks[s]):  # the shard's last chunk: piece c is chunk c's sum
                self._publish(w, "q2", s, sums[s])
            sizes = [0 if i == w.me else self.codec.nbytes(cut[i][1] - cut[i][0]) for i in range(m)]
            back = torch.empty(sum(sizes), dtype=torch.uint8)
            buf = _tensor(mine * (m - 1))
            ins = [0 if j == w.me else len(mine) for j in range(m)]
            second.append((s, c, back, sizes, mine, group.alltoall_base(back, buf, sizes, ins)))
            sent += buf.numel()
        for *_, work in second:
            work.wait()
        digests = self._fetch(w, "q2", chunks)
        out: dict[int, list[torch.Tensor]] = {s: [torch.empty(0)] * len(cs) for s, cs in chunks.items()}
        for s, c, back, sizes, mine, _ in second:
            summed, problem = self._gather(w, s, c, digests, back, sizes, mine, chunks[s][c][2])
            why = why or problem
            out[s][c] = summed
        return out, sent, why

    def _decode_whole(self, payloads: list[bytes], cut: list[tuple[int, int]]) -> torch.Tensor:
        return torch.cat([_decode(self.codec, p, b - a) for p, (a, b) in zip(payloads, cut, strict=True)])

    def _publish(self, w: Where, step: str, s: int, pieces: Sequence[bytes]) -> None:
        """Signed under this rank's key for shard ``s``: the HMAC of each piece it sends ('-' for none)."""
        key = self.key(w, step, s, w.members[w.me])
        self.published.setdefault(w.r, []).append(key)
        self.kv.set(key, " ".join(self.kv.signer.mac(f"{key}/{i}", p) if p else "-" for i, p in enumerate(pieces)))

    def _fetch(self, w: Where, step: str, chunks: dict[int, list[Any]]) -> dict[str, list[str] | Refused]:
        """Every other member's signed digests of ``step`` for every owned shard, in one wait and one
        read (not a round trip per piece): per key, the digests or why not."""
        keys = [self.key(w, step, s, g) for s in sorted(chunks) for i, g in enumerate(w.members) if i != w.me]
        if not self.kv.wait_all(keys, self.timeout_s):
            late = Refused("unauthenticated", f"the members' signed digests ({step}) did not arrive within {self.timeout_s:g} s")
            return dict.fromkeys(keys, late)
        out: dict[str, list[str] | Refused] = {}
        for key, value in zip(keys, self.kv.open_many(keys), strict=True):
            out[key] = (
                Refused("unauthenticated", f"{key} is not signed by the job") if value is None else value.decode("ascii", "replace").split()
            )
        return out

    def _check(self, digests: dict[str, list[str] | Refused], key: str, sender: str, index: int, piece: torch.Tensor) -> None:
        """``piece`` as ``sender`` signed it under ``key`` (its ``index``-th digest); Refused (counted) otherwise."""
        macs = digests[key]
        if isinstance(macs, Refused):
            raise macs
        if len(macs) <= index:
            raise Refused("malformed", f"{key} holds {len(macs)} digests, piece {index} was sent")
        if macs[index] == "-" and piece.numel() == 0:  # an empty part: nothing sent, nothing signed
            return
        try:
            self.kv.signer.check_mac(f"{key}/{index}", piece.numpy().data, macs[index])
        except Refused as e:
            self.kv.signer.refuse(f"{key}/{index}", e, log_it=False)
            raise Refused("unauthenticated", f"the bytes {sender} sent do not match its signed digest ({key})") from None

    def _reduce(
        self, w: Where, s: int, c: int, digests: dict[str, Any], got: torch.Tensor, outs: list[int], own: bytes, part: tuple[int, int]
    ) -> tuple[torch.Tensor | None, str]:
        """Step 2 for this member's part: the fp32 sum of the members' checked contributions in
        member order, or None and why."""
        n = part[1] - part[0]
        total = torch.zeros(n, dtype=torch.float32)
        offset = 0
        try:
            for i, size in enumerate(outs):
                if i == w.me:
                    total += _decode(self.codec, own, n)
                    continue
                piece = got[offset : offset + size]
                offset += size
                self._check(digests, self.key(w, "q1", s, w.members[i]), w.members[i], c * len(outs) + w.me, piece)
                total += _decode(self.codec, _bytes(piece), n)
        except Refused as e:
            return None, f"shard {s}: {e.kind}: {e.reason}"
        return total, ""

    def _sum_payload(self, total: torch.Tensor | None, part: tuple[int, int]) -> bytes:
        """The sum encoded once; an unusable payload when a contribution was refused (or the sum
        overflowed), so that every member refuses the chunk alike."""
        n = part[1] - part[0]
        if total is None:
            return unusable(self.codec, n)
        try:
            return self.codec.encode(total)
        except NonFinite:
            return unusable(self.codec, n)

    def _gather(
        self,
        w: Where,
        s: int,
        c: int,
        digests: dict[str, Any],
        back: torch.Tensor,
        sizes: list[int],
        mine: bytes,
        cut: list[tuple[int, int]],
    ) -> tuple[torch.Tensor, str]:
        """Step 3: every member's encoded sum, checked and decoded, in place: the chunk's sum."""
        out = torch.zeros(cut[-1][1], dtype=torch.float32)
        offset, why = 0, ""
        for i, size in enumerate(sizes):
            a, b = cut[i]
            try:
                if i == w.me:
                    out[a:b] = _decode(self.codec, mine, b - a)
                    continue
                piece = back[offset : offset + size]
                offset += size
                self._check(digests, self.key(w, "q2", s, w.members[i]), w.members[i], c, piece)
                out[a:b] = _decode(self.codec, _bytes(piece), b - a)
            except Refused as e:
                why = why or f"shard {s}: {e.kind}: {e.reason}"
        return out, why


def round_sum(
    ex: P2PExchange, groups: ShardGroups, ring: Ring, r: int, attempt: int, d: Decision, current: torch.Tensor
) -> tuple[int, dict[int, torch.Tensor], str]:
    """``P2PExchange._sum`` for int8 / fp8: every owned shard's pseudo-gradient encoded (with its
    residual), exchanged and summed as above (the caller hands a rejoining region the state, as on
    the fp16 path). Bytes sent, the sums (fp32), why a piece was refused ('')."""
    q = ex.quantized
    assert q is not None
    ex.phases.tick("other")
    make_groups(groups, ex.layout.mine)
    ex.phases.tick("groups")
    members = tuple(g for g, _ in ring.members)
    w = Where(r, attempt, ring.name, members.index(ex.region), members)
    outer = ex.layout.by_shard(ex.opt.params)
    deltas = {s: outer[s] - current[slice(*ex.layout.span(s))] for s in ex.layout.mine}
    q.begin(r)
    with one_thread():  # the codec's passes, as the fp16 path's: default OpenMP threads a rank oversubscribe the cores
        chunks, bad = q.prepare(groups, deltas, len(members), ex.region in d.fresh)
        for why in bad:  # the others refuse it at once, as the store path's leaders do
            log.warning("DiLoCo: region %s sends an unusable pseudo-gradient for round %d: %s", ex.region, r, why)
        ex.phases.tick("encode")
        corrupt = None if ex.corrupt is None else (lambda s, buf: ex.corrupt(r, s, buf))  # type: ignore[misc]
        out, sent, why = q.exchange(w, chunks, corrupt)
        ex.phases.tick("exchange")
    return sent, {s: torch.cat(out[s]) for s in ex.layout.mine}, why


def quantized_allreduce(
    store: object,
    kv: KV,
    members: Sequence[tuple[str, int]],
    region: str,
    rank: int,
    flat: torch.Tensor,
    c: Codec,
    *,
    streams: int = DEFAULT_STREAMS,
    bind: Bind = LOOPBACK,
    timeout_s: float = 60.0,
    tag: str = "diloco/bench",
) -> tuple[torch.Tensor, int]:
    """``sharded.sharded_allreduce`` in ``c``'s bytes (no error feedback): the decoded sum on every
    rank of every member and the bytes this rank sent. ``kv`` carries the signed digests (under a
    new prefix per call). For tests and benches; the trainer runs ``round_sum``."""
    sizes = dict(members)
    layout = Layout(flat.numel(), shard_count(list(sizes.values())), sizes[region], rank)
    region_group = gloo_group(store, f"{tag}/region/{region}/", rank, layout.n, bind, timeout_s) if layout.n > 1 else None
    ring = Ring(tuple(members), "bench")
    groups = ShardGroups(store, tag, layout, ring, region, streams, bind, timeout_s, GroupCache())
    make_groups(groups, layout.mine)
    names = tuple(g for g, _ in members)
    q = Quantized(c, kv, False, timeout_s)
    chunks, _ = q.prepare(groups, {s: flat[slice(*layout.span(s))] for s in layout.mine}, len(names))
    out, sent, why = q.exchange(Where(0, 0, ring.name, names.index(region), names), chunks)
    if why:
        raise Refused("unauthenticated", why)
    full, gathered = gather_in_region(region_group, layout, {s: torch.cat(out[s]) for s in layout.mine})
    return full, sent + gathered
