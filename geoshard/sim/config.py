"""The simulator's input: one frozen ``SimConfig`` built at the CLI edge (or by a planner), and
the few calibrated ``Constants`` of the machine the model describes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from geoshard.errors import ConfigError

TIERS = ("local", "s3", "alluxio")
# The constants that are this host's own work (Python, copies, process start), scaled by host_slowdown.
# The store's costs and the start-up skew are not among them: C4's rounds took the same time at a
# load of 14.4 and of 7.6 (2026-12-04 13:23 and 15:5x: 7.3 and 7.0 s a round; its later rounds
# 5.4-6.0 s both times): the store's one process and the regions' launch are paced by something
# other than this host's run queue.
HOST_COSTS = (
    "bucket_s",
    "trip_s",
    "hook_trip_s",
    "step_overhead_s",
    "startup_s",
    "s3_startup_s",
    "request_s",
    "batch_s",
    "checkpoint_s",
    "p2p_groups_s",
    "p2p_prepare_value_s",
    "p2p_mac_value_s",
    "p2p_check_value_s",
    "p2p_step_value_s",
    "p2p_gather_value_s",
    "p2p_fixed_s",
    "p2p_codec_value_s",
    "p2p_hmac_byte_s",
)
SYNCS = ("flat", "hierarchical", "diloco")
OUTER_TRANSPORTS = ("store", "p2p")
# Bytes a value of the pseudo-gradient takes on the wire, per --outer-compression (trainer/diloco/codec.py:
# int8 and fp8 carry one byte a value and a 4-byte scale per block of 1,024 values).
OUTER_BYTES = {"fp16": 2.0, "bf16": 2.0, "none": 4.0, "int8": 1 + 4 / 1024, "fp8": 1 + 4 / 1024}
SUMMABLE = ("fp16", "bf16", "none")  # summed by gloo's all-reduce; int8/fp8 go by reduce-scatter and all-gather (sim/p2p.py)


@dataclass(frozen=True)
class Constants:
    """What the model cannot derive from the options: fitted from the rehearsal's own measurements
    and a calibration set apart from the validation runs (docs/simulate.md, bench/simulate_bench.py)."""

    ceiling_mb_s: float | None = None  # the rehearsal's forwarder ceiling (MB/s); None: a real WAN, no forwarder
    mss: int = 1448  # TCP payload per segment: 1448 on a 1500-byte path; the rehearsal's TUN MTU 65,000 gives 64,948
    init_cwnd: int = 10  # segments (Linux's initial window)
    # The window a new connection's receiver starts with: Linux's tcp_rmem default (131,072 bytes)
    # at tcp_adv_win_scale 1, half the buffer; it grows each round trip as the reader reads. It is
    # the limit where init_cwnd x mss is larger (the rehearsal's 65,000 MTU; bench/get_probe.py).
    init_rwnd: int = 65_536
    ring_step_latencies: float = 2.0  # one-way latencies per ring step (gloo: the receiver announces its buffer, then the chunk)
    gloo_threads: int = 2  # ProcessGroupGloo's worker threads: flat's asynchronous bucket all-reduces run this many at once
    rto_min_s: float = 0.2  # Linux's minimum retransmission timeout: an idle flow past rtt + this restarts slow start
    bucket_s: float = 0.0  # the DDP comm hook's own time per bucket, network aside
    trip_s: float = 0.0  # per message overhead of a collective step or a store request (kernel, gloo, Python)
    # More per ring message under hierarchical's hook, which runs reduce, ring and broadcast
    # synchronously on the training thread (trainer/comm.py): each step waits for that thread to
    # be scheduled again; flat's asynchronous hook leaves the ring to gloo's own threads.
    hook_trip_s: float = 0.0
    local_mb_s: float = 2000.0  # a hop inside one region (loopback / the region's network)
    cpu_gflops: float = 10.0  # the built-in model's forward+backward rate per rank (6 x params x samples flops)
    step_overhead_s: float = 0.002  # per optimizer step outside compute: the loop's own bookkeeping
    startup_s: float = 1.0  # loader start to the first fetch: worker processes, the first read's set-up
    # A worker that reads a bucket makes its own S3 client first (a forked one's pooled connections
    # would be shared with its parent's): that much more start-up (geoshard/s3.py, bench/startup_bench.py).
    s3_startup_s: float = 0.0
    # The cores the ranks share: the ranks whose loaders start together (one world after its
    # rendezvous) share them, so the last one's start-up takes startup_s x ranks / cores (each
    # beyond the cores a share of their time). 0: every rank on cores of its own (nodes).
    host_cores: int = 0
    request_s: float = 0.005  # one storage request's service time (GET, manifest read)
    tier_mb_s: tuple[tuple[str, float], ...] = (("local", 500.0), ("s3", 100.0), ("alluxio", 200.0))  # one worker's fetch rate
    batch_s: float = 0.0005  # a batch's hand-off from a worker to the training process
    checkpoint_s: float = 0.05  # fixed cost of one checkpoint, besides its bytes at local_mb_s
    store_request_s: float = 0.0  # a store request's own cost beyond its round trip (TCPStore, signing, Python)
    # A byte through the outer store's own work (one TCPStore process serving every leader's
    # publish and multi_get, the signature, the checks). Fitted beside store_request_s from two
    # pseudo-gradient sizes (C4, C6); 0 on this machine (2026-12-04 16:2x): C6's 2.6 MB rounds
    # were no longer than C4's 1.6 MB ones.
    store_byte_s: float = 0.0
    outer_trips_before: int = 3  # store round trips before a round closes (roster, close, members)
    outer_trips_after: int = 3  # and after it (multi_get, latest, state)
    # The regions' start-up skew beyond their first batches' spread: each region's processes are
    # started one after another and import torch on a shared host, so the first DiLoCo round also
    # waits for the last region to arrive (the first round's excess over the later ones).
    startup_skew_s: float = 0.0
    # The peer-to-peer round (sim/p2p.py, trainer/diloco/p2p.py's phases). Host passes are seconds
    # a value of the shards a rank owns (one pass each); the MAC check's and the gather's are apart
    # from the rest so that a refit after they overlap the transfer is one command.
    # the slowest leader's store round trips once the last region is ready: it sees that ready
    # key, reads it, asks to close, waits for the members, reads them (membership.py ``decide``)
    p2p_member_trips: int = 5
    p2p_groups_s: float = 0.0  # the shards' gloo groups, made at once in the first round
    p2p_prepare_value_s: float = 0.0  # pseudo-gradient and its cast
    p2p_mac_value_s: float = 0.0  # the MAC projections published (while the chunks travel)
    p2p_check_value_s: float = 0.0  # the sum's projections checked
    p2p_step_value_s: float = 0.0  # the outer Nesterov step
    p2p_gather_value_s: float = 0.0  # a value of the whole vector gathered in a region of 2+ ranks (fp32 over loopback)
    p2p_fixed_s: float = 0.0  # the region's agreement and the rest of a round
    # p2p's start-up skew beyond the first batches' spread: its round 0 is a collective (every
    # region waits in join for the others), so the launch's stagger ends there, before the loop
    p2p_startup_skew_s: float = 0.0
    # int8/fp8 over p2p: not fitted (no such run yet). The HMAC: state_auth's SHA-256 measured
    # 0.13-0.34 GB/s on a busy core here (docs/diloco.md): 0.2 GB/s. The codec pass: decode,
    # sum and re-encode of a value, taken as 4 fp32 passes at the 2 GB/s of a plain copy (a guess).
    p2p_hmac_byte_s: float = 5e-9
    p2p_codec_value_s: float = 8e-9
    # How much slower this host's own work runs than where the host costs were fitted per unit: a
    # machine whose cores are shared (load L on c cores: about L/c); 1 on dedicated nodes.
    host_slowdown: float = 1.0

    def on_host(self) -> Constants:
        """The host costs at ``host_slowdown`` (the network's are the network's)."""
        if self.host_slowdown == 1.0:
            return self
        f = self.host_slowdown
        return replace(
            self,
            host_slowdown=1.0,
            **{name: getattr(self, name) * f for name in HOST_COSTS},
        )

    def tier_rate(self, tier: str) -> float:
        """One worker's fetch rate from ``tier`` in bytes/s."""
        return dict(self.tier_mb_s)[tier] * 1e6


@dataclass(frozen=True)
class RegionSpec:
    name: str
    ranks: int
    tier: str = "local"  # where its ranks read: local replica, its bucket (s3), Alluxio
    data_region: str | None = None  # the region whose bucket it reads (None: its own); another means egress
    samples: int = 0  # the region's corpus (0: unknown, an epoch never ends)


@dataclass(frozen=True)
class LinkSpec:
    a: str
    b: str
    latency_ms: float  # one way
    bandwidth_mbit: float | None = None  # per direction; None: no cap


@dataclass(frozen=True)
class SimConfig:
    regions: tuple[RegionSpec, ...]
    links: tuple[LinkSpec, ...] = ()
    steps: int = 100
    batch_size: int = 32
    accum_steps: int = 1
    num_workers: int = 2
    prefetch: int = 2
    sample_bytes: int = 1000
    shard_bytes: int = 64_000_000
    chunk_bytes: int = 512 << 10  # a shard's chunks (geoshard split's): a worker fetches its first piece by chunks
    manifest_bytes: int = 100_000  # the region manifest read before the first fetch
    params: int = 0  # the model's parameters (0: no model, no gradient exchange)
    tensor_params: tuple[int, ...] = ()  # its gradients in DDP's bucketing order (empty: params as one list of 1M tensors)
    step_time: float = 0.0  # stated compute per step (s)
    sync: str = "hierarchical"
    grad_compression: str = "none"
    fp32_after: int | None = None
    outer_steps: int = 100
    outer_overlap: int = 0
    outer_compression: str = "fp16"
    outer_transport: str = "store"
    outer_streams: int = 1
    checkpoint_every: int = 50
    prices: tuple[tuple[str, str, float], ...] = ()  # (from, to, USD per GB)
    constants: Constants = field(default_factory=Constants)

    def __post_init__(self) -> None:
        if not self.regions:
            raise ConfigError("simulate: at least one region")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ConfigError(f"simulate: a region appears twice in {', '.join(names)}")
        for r in self.regions:
            if r.ranks < 1 or r.tier not in TIERS:
                raise ConfigError(f"simulate: region {r.name}: ranks must be >= 1 and tier one of {', '.join(TIERS)}")
            if r.data_region is not None and r.data_region not in names:
                raise ConfigError(f"simulate: region {r.name} reads from {r.data_region}, which is not one of the job's regions")
        positive = ("steps", "batch_size", "accum_steps", "sample_bytes", "shard_bytes", "chunk_bytes", "outer_steps", "outer_streams")
        for k in (*positive, "checkpoint_every"):
            if getattr(self, k) < 1:
                raise ConfigError(f"simulate: {k.replace('_', '-')} must be at least 1, got {getattr(self, k)}")
        if self.sync not in SYNCS:
            raise ConfigError(f"simulate: sync must be one of {', '.join(SYNCS)}, got {self.sync!r}")
        if self.outer_transport not in OUTER_TRANSPORTS:
            raise ConfigError(f"simulate: outer transport must be one of {', '.join(OUTER_TRANSPORTS)}, got {self.outer_transport!r}")
        if self.outer_compression not in OUTER_BYTES:
            raise ConfigError(f"simulate: outer compression must be one of {', '.join(OUTER_BYTES)}, got {self.outer_compression!r}")
        if not 0 <= self.outer_overlap < self.outer_steps:
            raise ConfigError(f"simulate: outer-overlap must be at least 0 and below outer-steps ({self.outer_steps})")
        if len(self.regions) > 1:
            have = {frozenset((x.a, x.b)) for x in self.links}
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    if frozenset((a, b)) not in have:
                        raise ConfigError(f"simulate: the matrix has no link {a} - {b} (every pair of the job's regions needs one)")

    @property
    def world_size(self) -> int:
        return sum(r.ranks for r in self.regions)

    def link(self, a: str, b: str) -> LinkSpec | None:
        """The link between two regions; None inside one region."""
        if a == b:
            return None
        return self._links[frozenset((a, b))]

    @cached_property
    def _links(self) -> dict[frozenset[str], LinkSpec]:
        return {frozenset((x.a, x.b)): x for x in self.links}
