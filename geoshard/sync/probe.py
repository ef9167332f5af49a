"""``geoshard probe``: latency and throughput from this host to every region's bucket.

For each region of the plan with a bucket, in order, with one boto3 client per region (the
region's endpoint and profile, credentials from the AWS SDK chain):

1. a TCP connect to the endpoint with a short timeout, so a region that is down becomes an
   error cell in seconds instead of waiting out the SDK's connect timeout and retries;
2. a HEAD of the bucket (warm-up: credentials, TLS, pooled connection; not counted) and one
   LIST page of the prefix, which finds ``<prefix>/manifest.json`` and the largest object;
3. latency: ``samples`` HEADs (of the region manifest, else of the bucket) alternating with
   ``samples`` small GETs (the first 16 KiB of the manifest, else of an object, else a LIST of
   one key), on the warm connection; median and p90 of all of them;
4. throughput: ranged GETs of the first ``throughput_bytes`` (4 MB) of the largest object
   under the prefix, best of ``throughput_samples``. Nothing is written unless ``write=True``:
   then, when the prefix holds no object of at least 1 MB, the probe PUTs a 4 MB object
   ``<prefix>/.geoshard-probe`` (and reports the PUT's throughput), reads it, and deletes it.
   Without ``write`` and without such an object, the largest object there is read, whatever its
   size (the cell records how many bytes the figure is based on), or none is measured.

Errors name the bucket and the endpoint (user:password parts of endpoint URLs are dropped) and
carry error codes and exception types only, never SDK messages, so no credential can leak into
the output. A failing region is a cell with ``error`` set, never an exception.

The records are in ``probe_records``, their drawing (text and heatmap) in ``probe_render``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import statistics
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

from geoshard.errors import GeoshardError
from geoshard.plan import Plan, Region
from geoshard.s3 import REQUEST_TIMEOUT_S, classify, s3_client
from geoshard.sync.probe_records import ProbeCell, ProbeResult
from geoshard.sync.probe_render import render_heatmap, render_text
from geoshard.sync.remote import MANIFEST, BucketTarget
from geoshard.util.endpoints import display_endpoint

__all__ = [
    "PROBE_OBJECT",
    "ProbeCell",
    "ProbeResult",
    "ProbeSettings",
    "display_endpoint",
    "probe",
    "probe_region",
    "render_heatmap",
    "render_text",
]

log = logging.getLogger(__name__)

PROBE_OBJECT = ".geoshard-probe"
MB = 10**6
_SMALL_GET = 16 * 2**10
_MIN_THROUGHPUT_OBJECT = MB  # smaller objects measure request latency more than bandwidth
ClientFactory = Callable[[str | None, str | None, str | None], Any]  # (endpoint, profile, plan region)


@dataclass(frozen=True)
class ProbeSettings:
    regions: tuple[str, ...] = ()  # empty: every region of the plan that has a bucket
    samples: int = 5  # HEADs, and as many small GETs
    throughput_bytes: int = 4 * MB
    throughput_samples: int = 2
    write: bool = False  # allow the PUT (and DELETE) of <prefix>/.geoshard-probe
    connect_timeout: float = 3.0
    timeout_s: float = REQUEST_TIMEOUT_S  # each request's read bound (two tries): an endpoint that never answers
    default_endpoint: str | None = None  # for regions without an endpoint (AWS_ENDPOINT_URL*)

    def __post_init__(self) -> None:
        if self.samples < 1 or self.throughput_samples < 1 or self.throughput_bytes < 1 or self.connect_timeout <= 0:
            raise ValueError("ProbeSettings needs samples, throughput_samples, throughput_bytes >= 1 and connect_timeout > 0")


def probe(
    plan: Plan,
    settings: ProbeSettings | None = None,
    *,
    origin: str | None = None,
    client_factory: ClientFactory | None = None,
) -> ProbeResult:
    """Probe every region of ``plan`` that has a bucket (or those in ``settings.regions``), all
    at once: a region that hangs costs its own timeout, not the others'."""
    settings = settings or ProbeSettings()
    wanted = set(settings.regions)
    if wanted:
        for name in wanted:
            plan.region(name)  # ConfigError naming the plan's regions if unknown
    todo: list[Region] = []
    skipped: list[str] = []
    for region in plan.regions:
        if wanted and region.name not in wanted:
            continue
        if not region.bucket_name:
            skipped.append(region.name)
            continue
        todo.append(region)
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        cells = list(pool.map(lambda r: probe_region(r, settings, client_factory), todo))
    s = asdict(settings)
    s.pop("default_endpoint")  # may hold a user:password; the cells show each endpoint redacted
    return ProbeResult(
        origin=origin or socket.gethostname(),
        created=datetime.now(UTC).replace(microsecond=0).isoformat(),
        cells=tuple(cells),
        skipped=tuple(skipped),
        settings=s,
    )


def probe_region(region: Region, settings: ProbeSettings, client_factory: ClientFactory | None = None) -> ProbeCell:
    target = BucketTarget.of(region, settings.default_endpoint)
    shown = display_endpoint(target.endpoint)
    where = f"{target.url()} at {shown}"
    t0 = time.perf_counter()
    cell = ProbeCell(region=region.name, url=target.url(), endpoint=shown)
    try:
        if client_factory is None:
            client = s3_client(target.endpoint, target.profile, target.region, settings.timeout_s)
        else:
            client = client_factory(target.endpoint, target.profile, target.region)
    except Exception as e:
        return _with(cell, t0, error=_describe(e, where, region.name))
    with contextlib.closing(client):
        try:
            _check_reachable(client.meta.endpoint_url, settings.connect_timeout)
        except OSError as e:
            reason = e.strerror or type(e).__name__
            return _with(cell, t0, error=f"{where}: cannot connect: {reason}")
        run = _RegionProbe(client, target, settings)
        try:
            run.run()
        except Exception as e:
            # Keep what was measured before the failure; the error says what did not work.
            log.debug("probe of %s failed", where, exc_info=True)
            run.error = _describe(e, where, region.name)
        finally:
            run.cleanup()
    return _with(
        cell,
        t0,
        latency_ms_median=_ms(statistics.median(run.latencies)) if run.latencies else None,
        latency_ms_p90=_ms(_p90(run.latencies)) if run.latencies else None,
        latency_samples=len(run.latencies),
        throughput_mb_s=round(max(run.throughputs) / MB, 2) if run.throughputs else None,
        throughput_bytes=run.throughput_bytes,
        throughput_key=run.throughput_key,
        upload_mb_s=round(run.upload / MB, 2) if run.upload else None,
        error=run.error,
    )


class _RegionProbe:
    """The requests of one region's probe; results accumulate so a late failure keeps early numbers."""

    def __init__(self, client: Any, target: BucketTarget, settings: ProbeSettings) -> None:
        self.client, self.target, self.settings = client, target, settings
        self.bucket = target.bucket
        self.latencies: list[float] = []
        self.throughputs: list[float] = []  # bytes/s
        self.throughput_bytes = 0
        self.throughput_key: str | None = None
        self.upload: float | None = None
        self.error: str | None = None
        self._wrote: str | None = None

    def run(self) -> None:
        c, bucket = self.client, self.bucket
        c.head_bucket(Bucket=bucket)  # warm-up, and a clear error when the bucket is missing
        prefix = f"{self.target.prefix}/" if self.target.prefix else ""
        page = c.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1000)
        # Empty objects (folder markers) cannot serve a ranged GET (416), so they do not count.
        objects = {o["Key"]: int(o["Size"]) for o in page.get("Contents", []) if int(o["Size"]) > 0}
        manifest = self.target.key(MANIFEST)
        probe_key = self.target.key(PROBE_OBJECT)

        # HEAD and small GET: of the region manifest when there is one (what loaders fetch first).
        head: Callable[[], object] = (
            partial(c.head_object, Bucket=bucket, Key=manifest) if manifest in objects else partial(c.head_bucket, Bucket=bucket)
        )
        small = manifest if manifest in objects else min(objects, key=lambda k: objects[k], default=None)
        small_get: Callable[[], object] = (
            partial(self._get, small, _SMALL_GET)
            if small is not None
            else partial(c.list_objects_v2, Bucket=bucket, Prefix=prefix, MaxKeys=1)
        )
        for _ in range(self.settings.samples):
            for request in (head, small_get):
                t = time.perf_counter()
                request()
                self.latencies.append(time.perf_counter() - t)

        largest = max(objects, key=lambda k: objects[k], default=None)
        if probe_key in objects and self.settings.write:
            self._wrote = probe_key  # a leftover of an interrupted probe: ours to read and remove
        if (largest is None or objects[largest] < _MIN_THROUGHPUT_OBJECT) and self.settings.write:
            data = os.urandom(self.settings.throughput_bytes)  # incompressible, in case anything compresses
            self._wrote = probe_key
            t = time.perf_counter()
            c.put_object(Bucket=bucket, Key=probe_key, Body=data)
            self.upload = len(data) / (time.perf_counter() - t)
            largest, objects[probe_key] = probe_key, len(data)
        if largest is None:
            log.info("%s: no object to measure throughput with; write=True lets the probe upload one", self.target.url())
            return
        self.throughput_key = largest
        for _ in range(self.settings.throughput_samples):
            t = time.perf_counter()
            n = self._get(largest, self.settings.throughput_bytes)
            self.throughput_bytes = n
            if n:
                self.throughputs.append(n / (time.perf_counter() - t))

    def _get(self, key: str, nbytes: int) -> int:
        body = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{nbytes - 1}")["Body"]
        n = 0
        with contextlib.closing(body):
            while chunk := body.read(1 << 20):
                n += len(chunk)
        return n

    def cleanup(self) -> None:
        if self._wrote is None:
            return
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._wrote)
        except Exception as e:
            # Not fatal for the probe, but a leftover object belongs in the report.
            log.warning("%s: could not delete the probe object %s (%s)", self.target.url(), self._wrote, type(e).__name__)
            note = f"probe object s3://{self.bucket}/{self._wrote} left behind"
            self.error = f"{self.error}; {note}" if self.error else note


def _check_reachable(endpoint_url: str, timeout: float) -> None:
    u = urllib.parse.urlsplit(endpoint_url)
    port = u.port or (443 if u.scheme == "https" else 80)
    with socket.create_connection((u.hostname or "", port), timeout=timeout):
        pass


def _describe(e: Exception, where: str, region: str) -> str:
    """One line naming bucket and endpoint; codes and types only (SDK messages may quote headers)."""
    from botocore.exceptions import ClientError, ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    if isinstance(e, GeoshardError):  # the client factory's own (a profile the AWS config lacks)
        return f"{where}: {e.message}"
    f = classify(e)
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        # The probe's first request is HEAD bucket, whose 404 has no body to name the bucket.
        remedy = "bucket does not exist" if f.code in ("404", "NoSuchBucket") else f.remedy
        http = f" (HTTP {status})" if status and str(status) != f.code else ""
        return f"{where}: {e.operation_name} failed: {f.code}{http}" + (f"; {remedy}" if remedy else "")
    if f.code == "NoCredentials":
        return f"{where}: no AWS credentials found; set the AWS_* variables or regions.{region}.profile"
    if f.code == "ProfileNotFound":
        return f"{where}: AWS profile of regions.{region}.profile not found"
    if isinstance(e, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError, OSError)):
        return f"{where}: lost the connection to the endpoint ({f.code})"
    return f"{where}: probe failed ({type(e).__name__})"


def _with(cell: ProbeCell, t0: float, **kw: Any) -> ProbeCell:
    from dataclasses import replace

    return replace(cell, seconds=round(time.perf_counter() - t0, 3), **kw)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _p90(xs: Sequence[float]) -> float:
    """Nearest-rank 90th percentile: a time that was actually measured."""
    s = sorted(xs)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]
