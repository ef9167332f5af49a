"""Live Prometheus metrics of one training rank, served over HTTP while it trains.

Each ``Metrics`` has its own ``CollectorRegistry`` (never prometheus-client's global one, which
would also collect whatever else the process registers) and its own HTTP server thread. Every
series carries ``rank`` and ``region`` labels; ranks sharing a host need one port each.

Exposed (docs/grafana-dashboard.json draws them):

- ``geoshard_io_wait_share``: data wait / wall time since the loop started (0..1);
- ``geoshard_step_seconds``: histogram of step wall time;
- ``geoshard_data_wait_seconds_total``, ``geoshard_grad_sync_seconds_total``, ``geoshard_samples_total``;
- ``geoshard_tier_bytes_total{tier}``, ``geoshard_egress_bytes_total{source,reader}``: from the loader's stats;
- ``geoshard_tier_fetch_seconds{tier}``: mean latency of the tier's fetches since the previous step
  that had any;
- ``geoshard_gpu_utilization``: 0..1, only once given.

With ``port=None`` nothing is imported or started and every method returns at once.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any

from geoshard.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from geoshard.loaders.stats import RegionPair, StatsSnapshot
    from geoshard.trainer.record import StepRecord

log = logging.getLogger(__name__)

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _Instruments:
    """The metric objects of one rank, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry, rank: int, region: str) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        labels = ("rank", "region")
        own = {"rank": str(rank), "region": region}
        self.own = own
        self.io_wait_share = Gauge(
            "geoshard_io_wait_share", "Share of the training loop's wall time spent waiting for data.", labels, registry=registry
        ).labels(**own)
        self.step_seconds = Histogram(
            "geoshard_step_seconds", "Wall time of a training step.", labels, buckets=STEP_BUCKETS, registry=registry
        ).labels(**own)
        self.data_wait = Counter(
            "geoshard_data_wait_seconds_total", "Seconds blocked waiting for the next batch.", labels, registry=registry
        ).labels(**own)
        self.grad_sync = Counter(
            "geoshard_grad_sync_seconds_total", "Seconds in gradient all-reduce (overlaps backward).", labels, registry=registry
        ).labels(**own)
        self.outer_sync = Counter(
            "geoshard_outer_sync_seconds_total", "Seconds training waited for DiLoCo's outer rounds.", labels, registry=registry
        ).labels(**own)
        self.samples = Counter("geoshard_samples_total", "Samples trained on.", labels, registry=registry).labels(**own)
        # Not bound to our labels yet: an unmeasured GPU must be absent, not a misleading 0.
        self.gpu = Gauge("geoshard_gpu_utilization", "GPU utilization (0..1).", labels, registry=registry)
        self.tier_bytes = Counter("geoshard_tier_bytes_total", "Shard bytes fetched from each tier.", (*labels, "tier"), registry=registry)
        self.tier_fetch = Gauge(
            "geoshard_tier_fetch_seconds",
            "Mean latency of a shard fetch from each tier since the previous step with fetches.",
            (*labels, "tier"),
            registry=registry,
        )
        self.egress = Counter(
            "geoshard_egress_bytes_total",
            "Shard bytes read from another region's bucket, by source and reading region.",
            (*labels, "source", "reader"),
            registry=registry,
        )


class Metrics:
    """Prometheus metrics of one rank on ``host:port`` (``port=0``: any free port, see ``.port``)."""

    def __init__(self, port: int | None, rank: int, region: str, *, host: str = "127.0.0.1") -> None:
        self.rank = rank
        self.region = region
        self.host = host
        self.port: int | None = None
        self.registry: CollectorRegistry | None = None
        self._m: _Instruments | None = None
        self._server: Any = None
        self._thread: Any = None
        self._waited = 0.0
        self._tiers: dict[str, tuple[float, float, float]] = {}  # tier -> last (bytes, hits, fetch_seconds)
        self._egress: dict[RegionPair, int] = {}
        if port is None:
            return
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be 0..65535 (0: any free port), got {port!r}")
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        self._m = _Instruments(self.registry, rank, region)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"metrics: cannot listen on {host}:{port} ({e.strerror}); give each rank on a host its own port") from e
        self.port = int(self._server.server_address[1])
        log.info("rank %d metrics on http://%s:%d/metrics", rank, host, self.port)

    def observe_step(self, record: StepRecord, loader_stats: StatsSnapshot | None, *, gpu_util: float | None = None) -> None:
        """Count one step record (as written to steps-rank{R}.jsonl) and the loader's cumulative stats."""
        m = self._m
        if m is None:
            return
        wait = max(0.0, record.data_wait_s)
        self._waited += wait
        m.data_wait.inc(wait)
        m.grad_sync.inc(max(0.0, record.comm_s))
        m.outer_sync.inc(max(0.0, record.outer_sync_s))
        m.samples.inc(max(0, record.samples))
        m.step_seconds.observe(record.step_s)
        if record.t > 0:
            m.io_wait_share.set(min(1.0, self._waited / record.t))
        if gpu_util is not None:
            if not 0.0 <= gpu_util <= 1.0:
                raise ValueError(f"gpu_util is a fraction 0..1 (torch.cuda.utilization() / 100), got {gpu_util!r}")
            m.gpu.labels(**m.own).set(gpu_util)
        if loader_stats:
            self._observe_loader(m, loader_stats)

    def _observe_loader(self, m: _Instruments, stats: StatsSnapshot) -> None:
        # The loader's counters are cumulative; Prometheus counters take increments. A counter that
        # went down belongs to a new loader (new epoch or restart), so all of it is new.
        for tier, c in stats.tiers.items():
            now = (float(c.bytes), float(c.hits), float(c.fetch_seconds))
            before = self._tiers.get(tier, (0.0, 0.0, 0.0))
            if now[1] < before[1] or now[0] < before[0]:
                before = (0.0, 0.0, 0.0)
            self._tiers[tier] = now
            m.tier_bytes.labels(**m.own, tier=tier).inc(now[0] - before[0])
            hits = now[1] - before[1]
            if hits > 0:
                m.tier_fetch.labels(**m.own, tier=tier).set(max(0.0, now[2] - before[2]) / hits)
        for pair, n in stats.egress.items():
            last = self._egress.get(pair, 0)
            self._egress[pair] = n
            m.egress.labels(**m.own, source=pair.source, reader=pair.reader).inc(n - last if n >= last else n)

    def close(self) -> None:
        """Stop the HTTP server; the metrics stay readable through ``registry``."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
