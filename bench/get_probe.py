"""Where a ranged GET from another region's bucket spends its time under the WAN rehearsal, beside
the simulator's link model (issue 21: the loader's fetches from another region's bucket took
1.5-4x what ``geoshard simulate`` says). Needs root.

One SeaweedFS on the host holds an 8 MB object; ``Rehearsal.expose`` serves it from the bucket's
region's address (as bench/simulate_bench.py does). From each reading region's namespace a
worker (``--worker``) times, through the loader's own S3 tier (pooled boto3 client):

- ``cold``: the first 512 KiB range on a new client (a TCP connection to open);
- ``warm``: the next ranges one after another on the same client (the connection reused);
- ``overlap``: a second range started while the first still has 256 KiB to arrive, as the fetch
  queue starts a worker's next piece (loaders/fetchqueue.py): the pool opens a second connection;
- ``raw``: the same range over a plain socket with a hand-written request, no boto3 (the floor
  of the path without the client's own cost), on a fresh and on a kept-alive connection.

Each beside ``sim.loader.shard_fetch_s`` for one flow with the rehearsal's constants. Reading its
own region's bucket (``--pairs us-east-1=us-east-1``) gives the per-request cost without a link.

    sudo .venv/bin/python bench/get_probe.py
    sudo .venv/bin/python bench/get_probe.py --pairs ap-southeast-1=us-east-1,us-east-1=us-east-1 --repeats 5

``--mtu 1500`` gives a real path's segments (and the model its MSS); ``--sysctl KEY=VALUE`` a
``net.*`` setting in every namespace (``"net.ipv4.tcp_rmem=4096 4194304 16777216"``: a larger
initial receive buffer); ``--initrwnd N`` sets every route's ``initrwnd`` and ``initcwnd``. With
``raw`` each fresh and kept request's connect, first byte and last byte are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CHUNK = 512 << 10
LEAD = 256 << 10
OBJECT = 8 << 20


def worker(endpoint: str, bucket: str, key: str, repeats: int) -> dict[str, Any]:
    """In the reading region's namespace: each pattern's seconds, ``repeats`` times."""
    from geoshard.loaders.s3_tier import S3Tier

    out: dict[str, list[float]] = {"cold": [], "warm": [], "overlap_first": [], "overlap_second": [], "raw_fresh": [], "raw_kept": []}
    for rep in range(repeats):
        tier = S3Tier(bucket, endpoint=endpoint, region="probe")
        offsets = [((rep * 5 + i) % (OBJECT // CHUNK)) * CHUNK for i in range(5)]
        t = time.perf_counter()
        tier.read_range(key, offsets[0], CHUNK)
        out["cold"].append(time.perf_counter() - t)
        for off in offsets[1:3]:
            t = time.perf_counter()
            tier.read_range(key, off, CHUNK)
            out["warm"].append(time.perf_counter() - t)
        first, second = overlapped(tier, key, offsets[3], offsets[4])
        out["overlap_first"].append(first)
        out["overlap_second"] += second
        out["raw_fresh"].append(raw_get(endpoint, bucket, key, offsets[0], fresh=True))
        out["raw_kept"].append(raw_get(endpoint, bucket, key, offsets[1], fresh=False))
    return {**{k: [round(x, 4) for x in v] for k, v in out.items()}, "raw_phases": PHASES}


def overlapped(tier: Any, key: str, a: int, b: int) -> tuple[float, list[float]]:
    """Range ``a``, and range ``b`` started when ``a`` has ``LEAD`` bytes left to arrive (the fetch
    queue's rule): each one's seconds (the second's, if it finished within the bound)."""
    got = [0]
    go = threading.Event()
    second: list[float] = []

    def progress(n: int) -> None:
        got[0] += n
        if got[0] >= CHUNK - LEAD:
            go.set()

    def later() -> None:
        go.wait(30)
        t = time.perf_counter()
        tier.read_range(key, b, CHUNK)
        second.append(time.perf_counter() - t)

    th = threading.Thread(target=later)
    th.start()
    t = time.perf_counter()
    tier.read_range(key, a, CHUNK, progress)
    first = time.perf_counter() - t
    th.join(60)
    return first, second


_kept: dict[str, socket.socket] = {}
PHASES: dict[str, list[tuple[float, float, float]]] = {}  # connect, first byte, last byte (s from start)


def raw_get(endpoint: str, bucket: str, key: str, offset: int, fresh: bool) -> float:
    """One signed ranged GET over a plain socket: seconds from connect (fresh) or send (kept) to the last byte."""
    import botocore.auth
    import botocore.awsrequest
    import botocore.session

    host_port = endpoint.split("://", 1)[1]
    host, port = host_port.rsplit(":", 1)
    creds = botocore.session.get_session().get_credentials()
    if creds is None:
        raise SystemExit("get_probe worker: no credentials in the environment")
    url = f"{endpoint}/{bucket}/{key}"
    req = botocore.awsrequest.AWSRequest("GET", url, headers={"Range": f"bytes={offset}-{offset + CHUNK - 1}"})
    botocore.auth.SigV4Auth(creds, "s3", "us-east-1").add_auth(req)
    head = f"GET /{bucket}/{key} HTTP/1.1\r\nHost: {host_port}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in req.headers.items())
    data = (head + "\r\n").encode()
    t = time.perf_counter()
    s = None if fresh else _kept.get(endpoint)
    if s is None:
        s = socket.create_connection((host, int(port)), timeout=30)
        if not fresh:
            _kept[endpoint] = s  # timed once with its connect; later calls reuse it
    connected = time.perf_counter()
    s.sendall(data)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    first = time.perf_counter()
    header, body = buf.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(1 << 20)
    took = time.perf_counter() - t
    PHASES.setdefault("fresh" if fresh else "kept", []).append((round(connected - t, 4), round(first - t, 4), round(took, 4)))
    if fresh:
        s.close()
    return took


def set_initrwnd(ns: str, segments: int) -> None:
    """Every route of namespace ``ns`` with ``initrwnd`` (the receive window a new connection advertises)."""
    routes = subprocess.run(["ip", "-n", ns, "route", "show"], capture_output=True, text=True, check=True).stdout
    for line in routes.splitlines():
        if line.strip():
            argv = ["ip", "-n", ns, "route", "change", *line.split(), "initrwnd", str(segments), "initcwnd", str(segments)]
            subprocess.run(argv, check=True, capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="ap-southeast-1=us-east-1,eu-west-1=ap-southeast-1,us-east-1=eu-west-1,us-east-1=us-east-1",
                    help="READER=BUCKET_REGION, comma-separated")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matrix", type=Path, default=ROOT / "bench" / "wan-matrix.toml")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "_data" / "get_probe.json")
    ap.add_argument(
        "--initrwnd", type=int, help="set every region's routes' initial receive and congestion windows (segments): tests the cause"
    )
    ap.add_argument(
        "--sysctl", action="append", default=[], metavar="KEY=VALUE", help="a net.* setting in every region's namespace (repeatable)"
    )
    ap.add_argument("--mtu", type=int, default=None, help="the regions' interfaces' MTU (1500: a real path's segments)")
    ap.add_argument("--worker", nargs=3, metavar=("ENDPOINT", "BUCKET", "KEY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        endpoint, bucket, key = args.worker
        print(json.dumps(worker(endpoint, bucket, key, args.repeats)))
        return 0

    from servers import SeaweedS3

    from geoshard.sim import calibrated
    from geoshard.sim.config import LinkSpec
    from geoshard.sim.links import transfer_s
    from geoshard.wan import Rehearsal, load_matrix

    matrix = load_matrix(args.matrix)
    pairs = [tuple(p.split("=")) for p in args.pairs.split(",")]
    rows = []
    with SeaweedS3() as server:
        client = server.client()
        server.make_bucket("probe")
        client.put_object(Bucket="probe", Key="obj", Body=os.urandom(OBJECT))
        env = {**os.environ, **server.env(endpoint=False)}
        sysctls = dict(kv.split("=", 1) for kv in args.sysctl)
        with Rehearsal(matrix, sysctls=sysctls, **({"mtu": args.mtu} if args.mtu else {})) as wan:
            k = calibrated.REHEARSAL
            k = dataclasses.replace(k, ceiling_mb_s=wan.ceiling.mb_per_s, **({"mss": args.mtu - 52} if args.mtu else {}))
            exposed = {r: "http://{}:{}".format(*wan.expose(r, server.port)) for r in {b for _, b in pairs}}
            if args.initrwnd:
                for region in wan.regions:  # readers and senders (the bucket's relay sends)
                    set_initrwnd(wan.netns(region), args.initrwnd)
            for reader, source in pairs:
                argv = [sys.executable, "-P", __file__, "--worker", exposed[source], "probe", "obj", "--repeats", str(args.repeats)]
                r = subprocess.run(wan.exec_argv(reader, argv), env=env, capture_output=True, text=True, timeout=600, check=False)
                if r.returncode:
                    print(f"{reader} <- {source}: worker failed: {r.stderr[-1500:]}", file=sys.stderr)
                    return 1
                got = json.loads(r.stdout.strip().splitlines()[-1])
                m = matrix.link(reader, source) if reader != source else None
                link = LinkSpec(m.a, m.b, m.latency_ms, m.bandwidth_mbit) if m is not None else None
                model = k.request_s + (link.latency_ms / 1000 if link else 0.0) + transfer_s(CHUNK, link, k)
                med = {name: round(statistics.median(v), 4) for name, v in got.items() if v and name != "raw_phases"}
                rows.append({"reader": reader, "bucket": source, "model_s": round(model, 4), "median_s": med, "all": got})
                print(f"{reader} <- {source} (model {model:.3f} s): " + ", ".join(f"{n} {s:.3f}" for n, s in med.items()))
                print(f"    raw (connect, first byte, last byte): {got['raw_phases']}")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(
        json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load": os.getloadavg()[0], "rows": rows}, indent=1)
    )
    print(f"JSON: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
