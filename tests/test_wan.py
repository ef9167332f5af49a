"""The WAN rehearsal: the matrix file, and real namespaces, TUN devices and forwarder (as root).

Traffic goes only between the namespaces the tests create (198.18.0.0/15); each test removes them.
Peers inside the namespaces are real processes started through ``Rehearsal.exec_argv``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import SeaweedS3

from geoshard.errors import ConfigError
from geoshard.wan import Rehearsal, load_matrix, parse_matrix, require_root, write_matrix
from geoshard.wan import netns as wan_netns
from geoshard.wan.errors import NeedsRootError, WanError
from geoshard.wan.matrix import Link, matrix_from_rtts
from geoshard.wan.rehearsal import paced_default

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from netproxy import NetProxy

GEOSHARD = str(Path(sys.executable).parent / "geoshard")
US, EU, AP = "us-east-1", "eu-west-1", "ap-southeast-1"


def _root_reason() -> str | None:
    try:
        require_root()
    except NeedsRootError as e:
        return str(e)
    return None


needs_root = pytest.mark.skipif(_root_reason() is not None, reason=_root_reason() or "")


def matrix_text(latency: float, bandwidth: float | None = None, regions: tuple[str, ...] = (US, EU, AP)) -> str:
    out = []
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            out += ["[[link]]", f'a = "{a}"', f'b = "{b}"', f"latency_ms = {latency}"]
            if bandwidth is not None:
                out.append(f"bandwidth_mbit = {bandwidth}")
            out.append("")
    return "\n".join(out)


def host_tun_devices() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True, timeout=10).stdout
    return [line.split(":")[1].strip() for line in out.splitlines() if line.split(":")[1].strip().startswith("gsw")]


def processes_with(needle: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmd and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def wait_until(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


# -- the matrix file ------------------------------------------------------------------------------

GOOD = """
[[link]]
a = "us-east-1"
b = "eu-west-1"
latency_ms = 38        # one way
bandwidth_mbit = 200

[[link]]
a = "us-east-1"
b = "ap-southeast-1"
latency_ms = 110
queue_ms = 50
"""


def test_matrix_parses_into_frozen_links(tmp_path: Path) -> None:
    path = tmp_path / "wan.toml"
    path.write_text(GOOD)
    m = load_matrix(path)
    assert m.regions == (US, EU, AP)
    assert m.link(EU, US) == Link(a=US, b=EU, latency_ms=38.0, bandwidth_mbit=200.0)
    assert m.link(US, AP).bandwidth_mbit is None and m.link(US, AP).queue_ms == 50.0
    assert m.link(US, EU).bytes_per_s == 25e6
    with pytest.raises(AttributeError):
        m.links[0].latency_ms = 1  # type: ignore[misc]
    assert m.check_regions([US, EU]) == (US, EU)


BAD = [
    ("not toml [", "invalid TOML"),
    ("[[link]]\na = 'us-east-1'\nb = 'eu-west-1'\n", ":1: link[0].latency_ms: missing"),
    ("\n[[link]]\na = 'us-east-1'\nb = 'eu-west-1'\nlatency_ms = -1\n", ":5: link[0].latency_ms: must be a number >= 0"),
    ("[[link]]\na = 'us-east-1'\nb = 'eu-west-1'\nlatency_ms = true\n", ":4: link[0].latency_ms: must be a number"),
    (
        "[[link]]\na = 'us-east-1'\nb = 'eu-west-1'\nlatency_ms = 1\nbandwidth_mbit = 0\n",
        ":5: link[0].bandwidth_mbit: must be a number > 0",
    ),
    ("[[link]]\na = 'us-east-1'\nb = 'eu-west-1'\nlatency_ms = 1\nlatncy = 3\n", ":5: link[0].latncy: unknown key"),
    ("[[link]]\na = 'us-east-1'\nb = 'us-east-1'\nlatency_ms = 1\n", ":3: link[0].b: a link joins two different regions"),
    ("[[link]]\na = 'US East'\nb = 'eu-west-1'\nlatency_ms = 1\n", ":2: link[0].a: must be a region name"),
    ("[[link]]\nb = 'eu-west-1'\nlatency_ms = 1\n", ":1: link[0].a: missing"),
    (
        "[[link]]\na = 'us-east-1'\nb = 'eu-west-1'\nlatency_ms = 1\n[[link]]\na = 'eu-west-1'\nb = 'us-east-1'\nlatency_ms = 2\n",
        ":7: link[1].b: eu-west-1 and us-east-1 already have a link (link[0])",
    ),
    ("latency_ms = 3\n", ":1: latency_ms: unknown key"),
    ("", "link: the matrix has no links"),
    ("link = 3\n", "link: must be an array of tables"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_matrix_errors_are_one_line_naming_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_matrix(path)
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    assert expected in msg, msg
    assert e.value.exit_code == 2


def test_regions_the_matrix_lacks_are_config_errors(tmp_path: Path) -> None:
    m = parse_matrix(GOOD, source="wan.toml")
    with pytest.raises(ConfigError, match=r"^wan.toml: region 'sa-east-1' has no \[\[link\]\] in the matrix"):
        Rehearsal(m, regions=(US, "sa-east-1"))
    with pytest.raises(ConfigError, match=r"^wan.toml: no \[\[link\]\] between 'eu-west-1' and 'ap-southeast-1'"):
        Rehearsal(m)  # all three regions, but eu-west-1 <-> ap-southeast-1 has no link
    with pytest.raises(ConfigError, match="at least two regions"):
        Rehearsal(m, regions=(US,))
    with pytest.raises(ConfigError, match="not found"):
        load_matrix(tmp_path / "missing.toml")


def test_matrix_written_from_round_trips_loads_back(tmp_path: Path) -> None:
    links = matrix_from_rtts({(US, EU): 76.0, (EU, US): 77.0, (US, AP): 221.5, (US, US): 0.2})
    path = write_matrix(tmp_path / "wan.toml", links, comment="measured by a test")
    text = path.read_text()
    assert text.startswith("# measured by a test\n")
    m = load_matrix(path)
    assert [(x.a, x.b, x.latency_ms, x.bandwidth_mbit) for x in m.links] == [(US, EU, 38.0, None), (US, AP, 110.75, None)]
    assert [p.name for p in tmp_path.iterdir()] == ["wan.toml"]  # no temporary file left


def test_cli_bad_matrix_is_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[[link]]\na = 'us-east-1'\nb = 'eu-west-1'\nlatency_ms = 'far'\n")
    r = subprocess.run([GEOSHARD, "wan", "check", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr == f"geoshard: error: {path}:4: link[0].latency_ms: must be a number >= 0 and <= 10000, got 'far'\n"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop capabilities")
def test_without_root_one_line_and_exit_2(tmp_path: Path) -> None:
    # uid 0 without capabilities (an empty bounding set): what a user, or root in a locked-down container, has
    path = tmp_path / "wan.toml"
    path.write_text(matrix_text(10.0, regions=(US, EU)))
    r = subprocess.run(
        ["setpriv", "--bounding-set=-all", "--", GEOSHARD, "wan", "check", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr == (
        "geoshard: error: the WAN rehearsal needs root (CAP_NET_ADMIN) for network namespaces and TUN devices; run it as root\n"
    )


@pytest.mark.slow
def test_probe_write_wan_sets_this_regions_links(s3: SeaweedS3, tmp_path: Path) -> None:
    """`geoshard probe --write-wan` run in us-east-1: eu-west-1's bucket sits behind a 40 ms (one way) proxy."""
    s3.make_bucket(bucket := "wan-probe")
    with contextlib.closing(s3.client()) as c:
        c.put_object(Bucket=bucket, Key="d/manifest.json", Body=b'{"version": 1, "shards": []}')
    matrix = tmp_path / "wan.toml"
    matrix.write_text(
        '[[link]]\na = "eu-west-1"\nb = "us-east-1"\nlatency_ms = 1\nbandwidth_mbit = 100\n\n'
        '[[link]]\na = "eu-west-1"\nb = "ap-southeast-1"\nlatency_ms = 85\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in SeaweedS3.UNSET_ENV and not k.startswith("GEOSHARD")}
    env.update(s3.env(endpoint=False))
    with NetProxy.to_url(s3.endpoint, latency_s=0.04) as far:
        plan = tmp_path / "plan.toml"
        plan.write_text(
            f'[regions.us-east-1]\nweight = 1\nbucket = "s3://{bucket}/d"\nendpoint = "{s3.endpoint}"\n'
            f'[regions.eu-west-1]\nweight = 1\nbucket = "s3://{bucket}/d"\nendpoint = "{far.endpoint}"\n'
        )
        argv = [GEOSHARD, "probe", "--plan", str(plan), "--png", str(tmp_path / "p.png"), "--samples", "3", "--write-wan", str(matrix)]
        no_region = {k: v for k, v in env.items() if k not in ("AWS_REGION", "AWS_DEFAULT_REGION")}
        unknown = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=no_region)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**env, "GEOSHARD_REGION": "us-east-1"})
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert unknown.stderr.startswith(f"geoshard: error: {matrix}: this host's region is unknown; set GEOSHARD_REGION"), unknown.stderr
    assert r.returncode == 0, r.stderr
    m = load_matrix(matrix)
    link = m.link("us-east-1", "eu-west-1")
    assert 40.0 <= link.latency_ms <= 60.0, link  # half a HEAD or small GET: the 40 ms each way, plus the server's time
    assert link.bandwidth_mbit == 100.0  # the cap set by hand survives
    assert m.link("eu-west-1", "ap-southeast-1").latency_ms == 85.0  # another host's link is kept
    assert matrix.read_text().startswith("# geoshard probe from ")
    assert f"WAN matrix {matrix}: us-east-1 <-> eu-west-1 {link.latency_ms:g} ms one way\n" in r.stdout
    assert s3.secret_key not in matrix.read_text() + r.stdout + r.stderr


# -- the rehearsal, as root -----------------------------------------------------------------------

ECHO_SERVER = """
import socket, sys
addr = sys.argv[1]
lo = socket.create_server(("127.0.0.1", 0))
srv = socket.create_server((addr, 0))
print(srv.getsockname()[1], lo.getsockname()[1], flush=True)
srv.settimeout(20)
conn, _ = srv.accept()
conn.settimeout(20)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(4096):
    conn.sendall(data)
"""

ECHO_CLIENT = """
import errno, json, socket, sys, time
addr, port, loport, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = socket.create_connection((addr, port), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for i in range(rounds + 1):
    t0 = time.perf_counter()
    c.sendall(b"x" * 100)
    got = 0
    while got < 100:
        got += len(c.recv(100 - got))
    if i:
        rtts.append(time.perf_counter() - t0)
c.close()
def refused(target):
    try:
        socket.create_connection(target, timeout=5).close()
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
print(json.dumps({"rtts": rtts, "peer_loopback": refused(("127.0.0.1", loport)), "unknown": refused(("198.18.0.99", 9))}))
"""

SINK = """
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
srv.settimeout(20)
conn, _ = srv.accept()
conn.settimeout(20)
marks = []
total = 0
while data := conn.recv(1 << 20):
    total += len(data)
    marks.append((time.monotonic(), total))
print(json.dumps(marks))
"""

SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
end = time.monotonic() + float(sys.argv[3])
data = bytes(1 << 16)
while time.monotonic() < end:
    c.sendall(data)
c.close()
"""


def py(*args: str) -> list[str]:
    return [sys.executable, "-P", "-c", *args]


@pytest.fixture(scope="module")
def two_regions() -> Iterator[Rehearsal]:
    if _root_reason():
        pytest.skip(_root_reason() or "")
    m = parse_matrix(matrix_text(20.0, bandwidth=40.0, regions=(US, EU)), source="two.toml")
    with Rehearsal(m) as wan:
        yield wan


@needs_root
def test_rtt_between_namespaces_matches_the_matrix(two_regions: Rehearsal) -> None:
    wan = two_regions
    before = wan.counters()
    with subprocess.Popen(wan.exec_argv(EU, py(ECHO_SERVER, wan.address(EU))), stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            port, loport = server.stdout.readline().split()
            client = subprocess.run(
                wan.exec_argv(US, py(ECHO_CLIENT, wan.address(EU), port, loport, "10")), capture_output=True, text=True, timeout=60
            )
            assert client.returncode == 0, client.stderr
        finally:
            server.kill()
    doc = json.loads(client.stdout)
    median_ms = statistics.median(doc["rtts"]) * 1000
    assert median_ms == pytest.approx(40.0, rel=0.10), doc["rtts"]  # 20 ms each way
    assert min(doc["rtts"]) * 1000 >= 40.0 * 0.97  # never early: the delay is a floor
    # loopback is private to each namespace; only the regions' addresses are routed
    assert doc["peer_loopback"] == "ECONNREFUSED"
    assert doc["unknown"] == "ENETUNREACH"
    after = wan.counters()
    sent, packets = (after[(US, EU)][i] - before[(US, EU)][i] for i in (0, 1))
    assert packets >= 11 and sent >= 11 * 100, after
    assert after[(EU, US)][1] - before[(EU, US)][1] >= 11


RTT_CLIENT = """
import json, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for i in range(11):
    t0 = time.perf_counter()
    c.sendall(b"y" * 100)
    got = b""
    while len(got) < 100:
        got += c.recv(100 - len(got))
    assert got == b"y" * 100
    rtts.append(time.perf_counter() - t0)
print(json.dumps(statistics.median(rtts[1:])))
"""


@needs_root
def test_expose_serves_a_host_service_at_a_regions_address(two_regions: Rehearsal) -> None:
    """One echo server on the host's loopback, exposed in eu-west-1: local there, 40 ms away from us-east-1."""
    wan = two_regions
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(20)

    def serve() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(4096):
                    conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with server:
        addr, port = wan.expose(EU, server.getsockname()[1])
        assert addr == wan.address(EU)
        before = wan.counters()[(US, EU)][0]
        rtt = {}
        for region in (EU, US):
            r = subprocess.run(wan.exec_argv(region, py(RTT_CLIENT, addr, str(port))), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            rtt[region] = json.loads(r.stdout) * 1000
        t.join(10)
    assert rtt[EU] < 10.0, rtt  # the region's own service: no link in between
    # From another region: the link's 40 ms round trip is a floor; the relay's threads (in this
    # busy test process) add their wake-ups on top, so the ceiling is looser than the RTT test's.
    assert 40.0 * 0.97 <= rtt[US] <= 40.0 * 1.5, rtt
    assert wan.counters()[(US, EU)][0] - before >= 11 * 100
    with pytest.raises(WanError, match="not a loopback address"):
        wan.expose(EU, 80, host="10.0.0.1")


@needs_root
@pytest.mark.slow
def test_throughput_within_15_percent_of_the_cap(two_regions: Rehearsal) -> None:
    wan = two_regions
    before = wan.counters()[(US, EU)][0]
    with subprocess.Popen(wan.exec_argv(EU, py(SINK, wan.address(EU))), stdout=subprocess.PIPE, text=True) as sink:
        try:
            assert sink.stdout is not None
            port = sink.stdout.readline().strip()
            sender = subprocess.run(wan.exec_argv(US, py(SENDER, wan.address(EU), port, "4")), capture_output=True, text=True, timeout=60)
            assert sender.returncode == 0, sender.stderr
            out, _ = sink.communicate(timeout=30)
        finally:
            sink.kill()
    marks = json.loads(out)
    t_first = marks[0][0]
    window = [(t, n) for t, n in marks if t >= t_first + 1.0]  # after slow start
    rate_mbit = (window[-1][1] - window[0][1]) * 8 / 1e6 / (window[-1][0] - window[0][0])
    assert rate_mbit == pytest.approx(40.0, rel=0.15), rate_mbit
    # the forwarder counted every byte that crossed: the payload, headers, and TCP's retransmissions
    crossed = wan.counters()[(US, EU)][0] - before
    assert marks[-1][1] <= crossed <= marks[-1][1] * 1.10, (crossed, marks[-1][1])


RANK = """
import datetime, json, sys, time
import torch
import torch.distributed as dist
rank, master, port, iters, phases = (int(a) if a.isdigit() else a for a in sys.argv[1:6])
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
t = torch.ones(1024)
for _ in range(2):
    dist.all_reduce(t)
for phase in range(phases):
    if rank == 0:
        print("ready", flush=True)
        sys.stdin.readline()  # the test has set this phase's matrix
    dist.barrier()
    t = torch.full((1024,), float(rank + 1))
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
        t /= 3
    times = [None] * 3
    dist.all_gather_object(times, time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"seconds": min(times), "value": t[0].item()}), flush=True)
dist.destroy_process_group()
"""


@needs_root
@pytest.mark.slow
def test_gloo_allreduce_across_three_namespaces_slows_with_latency() -> None:
    """3 gloo ranks, one per region namespace (TCPStore in us-east-1), under two matrices in turn."""
    iters, latencies = 10, (5.0, 40.0, 20.0)
    m = parse_matrix(matrix_text(latencies[0]), source="5ms.toml")
    seconds = []
    with Rehearsal(m, measure_ceiling=False) as wan:
        regions = wan.regions
        procs = []
        for rank, r in enumerate(regions):
            env = {**os.environ, **wan.env(r)}
            argv = py(RANK, str(rank), wan.address(regions[0]), "29511", str(iters), str(len(latencies)))
            procs.append(
                subprocess.Popen(
                    wan.exec_argv(r, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
                )
            )
        rank0 = procs[0]
        assert rank0.stdin is not None and rank0.stdout is not None
        try:
            for latency in latencies:
                assert rank0.stdout.readline() == "ready\n"
                wan.set_matrix(parse_matrix(matrix_text(latency), source=f"{latency}ms.toml"))
                before = sum(b for b, _ in wan.counters().values())
                rank0.stdin.write("go\n")
                rank0.stdin.flush()
                doc = json.loads(rank0.stdout.readline())
                assert doc["value"] == pytest.approx(2.0)  # the mean of 1, 2 and 3: every rank saw every other
                assert sum(b for b, _ in wan.counters().values()) - before > iters * 3 * 4096  # through the forwarder
                seconds.append(doc["seconds"])
        finally:
            for p in procs:
                try:
                    _, err = p.communicate(timeout=60)
                finally:
                    p.kill()
                assert p.returncode == 0, err[-2000:]
    # Expected: time grows linearly with the one-way latency, by k sequential one-way trips per
    # all-reduce, k at least the ring's 2(n-1) = 4 for 3 ranks (gloo waits for a notification
    # before most sends, so k lands above that bound). Check the slope, then that the third matrix
    # lands on the line the other two draw.
    (l0, l1, l2), (t0, t1, t2) = latencies, seconds
    trips = (t1 - t0) / iters / ((l1 - l0) / 1000)
    assert 4.0 <= trips <= 12.0, (seconds, trips)
    on_line = t0 + (t1 - t0) * (l2 - l0) / (l1 - l0)
    assert t2 == pytest.approx(on_line, rel=0.10), (seconds, trips)
    for latency, t in zip(latencies, seconds, strict=True):
        assert t / iters >= 4 * latency / 1000


LAUNCHER = """
import json, subprocess, sys, time
from geoshard.wan import Rehearsal, parse_matrix
wan = Rehearsal(parse_matrix(sys.argv[1]), measure_ceiling=False).start()
child = subprocess.Popen(wan.exec_argv("eu-west-1", ["sleep", "300"]))
print(json.dumps({"netns": [wan.netns(r) for r in wan.regions], "child": child.pid, "forwarder": wan.forwarder_pid}), flush=True)
time.sleep(300)
"""


def start_launcher() -> tuple[subprocess.Popen[str], dict]:  # type: ignore[type-arg]
    p = subprocess.Popen(py(LAUNCHER, matrix_text(5.0, regions=(US, EU))), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, p.stderr.read() if p.stderr else ""
    info = json.loads(line)
    listed = wan_netns.list_namespaces()
    assert set(info["netns"]) <= set(listed)
    assert alive(info["child"]) and alive(info["forwarder"])
    return p, info


def assert_all_gone(info: dict, launcher_pid: int) -> None:  # type: ignore[type-arg]
    def gone() -> bool:
        left = set(info["netns"]) & set(wan_netns.list_namespaces())
        return not left and not alive(info["child"]) and not alive(info["forwarder"])

    assert wait_until(gone, 10.0), (wan_netns.list_namespaces(), alive(info["child"]), alive(info["forwarder"]))
    # (a rehearsal starting elsewhere meanwhile has a device in the host for a few ms, so wait a little)
    assert wait_until(lambda: not host_tun_devices(), 5.0), host_tun_devices()
    assert wait_until(lambda: not processes_with(f"geoshard.wan.watchdog {launcher_pid} "), 10.0)


@needs_root
def test_sigkill_of_the_launcher_leaves_nothing() -> None:
    p, info = start_launcher()
    with p:
        p.kill()
    assert_all_gone(info, p.pid)


@needs_root
def test_sigterm_of_the_launcher_unwinds_and_leaves_nothing() -> None:
    p, info = start_launcher()
    with p:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 128 + signal.SIGTERM
    assert_all_gone(info, p.pid)


@needs_root
def test_normal_stop_and_exceptions_leave_nothing() -> None:
    m = parse_matrix(matrix_text(5.0, regions=(US, EU)))
    with pytest.raises(RuntimeError, match="boom"), Rehearsal(m, measure_ceiling=False) as wan:
        names = [wan.netns(r) for r in wan.regions]
        child = subprocess.Popen(wan.exec_argv(US, ["sleep", "300"]))
        forwarder = wan.forwarder_pid
        assert forwarder is not None and set(names) <= set(wan_netns.list_namespaces())
        inside = subprocess.run(wan.exec_argv(US, ["ip", "-o", "addr", "show", "dev", wan.ifname(US)]), capture_output=True, text=True)
        assert f"{wan.ifname(US)}    inet {wan.address(US)}/32" in inside.stdout, inside.stdout
        raise RuntimeError("boom")
    assert child.wait(timeout=5) == -signal.SIGTERM  # what ran inside was stopped
    assert not set(names) & set(wan_netns.list_namespaces())
    assert not alive(forwarder)
    assert wait_until(lambda: not host_tun_devices(), 5.0), host_tun_devices()


@needs_root
def test_start_clears_what_a_crashed_run_left() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: the owner of the stale namespace is gone
    stale = wan_netns.namespace_name(dead.pid, 1, "us-east-1")
    wan_netns.add_namespace(stale)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "300"])
    try:
        assert wait_until(lambda: sleeper.pid in wan_netns.namespace_pids(stale), 5.0)
        with Rehearsal(parse_matrix(matrix_text(5.0, regions=(US, EU))), measure_ceiling=False):
            assert stale not in wan_netns.list_namespaces()
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
        if stale in wan_netns.list_namespaces():
            wan_netns.delete_namespace(stale)


@needs_root
@pytest.mark.slow
def test_cli_wan_check_prints_ceiling_and_rtt_per_pair(tmp_path: Path) -> None:
    path = tmp_path / "wan.toml"
    path.write_text(matrix_text(25.0, regions=(US, EU, AP)))
    r = subprocess.run([GEOSHARD, "wan", "check", str(path), "--rounds", "9"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 8, r.stdout
    assert lines[0].startswith(
        f"WAN rehearsal of {path}: 3 namespaces (us-east-1 198.18.0.1, eu-west-1 198.18.0.2, ap-southeast-1 198.18.0.3)"
    )
    assert lines[1].startswith("forwarder ceiling: ") and "packets/s" in lines[1] and "MB/s" in lines[1]
    assert lines[2].split() == ["pair", "one", "way", "RTT", "want", "RTT", "got", "error", "cap", "got"]
    for line, (a, b) in zip(lines[3:6], [(US, EU), (US, AP), (EU, AP)], strict=True):
        cells = line.split()
        assert cells[:3] == [a, "<->", b] and cells[3:5] == ["25", "ms"] and cells[5:7] == ["50.0", "ms"], line
        assert float(cells[7]) == pytest.approx(50.0, rel=0.10), line
        assert cells[-2:] == ["none", "-"], line
    assert lines[6].startswith("delayed packets left ") and " ms late on average (max " in lines[6]
    assert lines[7] == "removed its 3 namespaces and their TUN devices"
    assert not [n for n in wan_netns.list_namespaces() if not alive(wan_netns.owner_of(n) or 0)]  # the command's own are gone


def test_rehearsal_refuses_a_setting_outside_net_and_a_bad_mtu() -> None:
    """Checked before any namespace exists: one line naming the key or the value."""
    m = parse_matrix(matrix_text(5.0, regions=(US, EU)), source="m.toml")
    with pytest.raises(WanError, match=r"sysctl 'kernel.panic': only net.core.\* and net.ipv4.\*"):
        Rehearsal(m, sysctls={"kernel.panic": "1"})
    with pytest.raises(WanError, match=r"sysctl net.ipv4.tcp_mtu_probing: value '1; reboot'"):
        Rehearsal(m, sysctls={"net.ipv4.tcp_mtu_probing": "1; reboot"})
    with pytest.raises(WanError, match="mtu must be 576-65000, got 70000"):
        Rehearsal(m, mtu=70000)


@needs_root
def test_the_rehearsals_namespaces_pace_with_bbr_where_the_host_allows_it(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.write_text("reno bbr cubic\n")
    assert paced_default(allowed) == {"net.ipv4.tcp_congestion_control": "bbr"}
    allowed.write_text("reno cubic\n")
    assert paced_default(allowed) == {}
    assert paced_default(tmp_path / "absent") == {}
    # the real namespaces: bbr unless the host does not allow it, whatever the host's own default
    cc = "net.ipv4.tcp_congestion_control"
    want = "bbr" if paced_default() else wan_netns.sysctl_path(cc).read_text().strip()
    with Rehearsal(parse_matrix(matrix_text(5.0, regions=(US, EU)), source="m.toml"), measure_ceiling=False) as wan:
        for r in (US, EU):
            assert wan_netns.get_sysctl(wan.netns(r), cc) == want


@needs_root
def test_rehearsal_sets_mtu_and_tcp_settings_in_each_namespace_only() -> None:
    """A region's namespace takes the given MTU and net.* settings (its hosts' tuning); the host keeps its own."""
    key, cc = "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_congestion_control"
    host = {k: wan_netns.sysctl_path(k).read_text().strip() for k in (key, cc)}
    want = {key: "0" if host[key] == "1" else "1", cc: "reno" if host[cc] != "reno" else "bbr"}  # both always allowed here
    m = parse_matrix(matrix_text(5.0, regions=(US, EU)), source="m.toml")
    with Rehearsal(m, measure_ceiling=False, mtu=1500, sysctls=want) as wan:
        for r in (US, EU):
            ns = wan.netns(r)
            got = subprocess.run(
                [wan_netns.ip_binary(), "netns", "exec", ns, "cat", str(wan_netns.sysctl_path(key)), str(wan_netns.sysctl_path(cc))],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.split()
            assert got == [want[key], want[cc]]
            assert " mtu 1500 " in wan_netns.run_ip("-n", ns, "link", "show", "wan0")
        # A TCP transfer crosses at the small MTU: 1 MB from eu-west-1 to a listener in us-east-1.
        with wan_netns.inside(wan.netns(US)):
            listener = socket.create_server((wan.address(US), 0))
        port = listener.getsockname()[1]
        sender = subprocess.Popen(
            wan.exec_argv(EU, [sys.executable, "-c", SEND_1MB, wan.address(US), str(port)]), stderr=subprocess.PIPE, text=True
        )
        listener.settimeout(30)
        conn, _ = listener.accept()
        conn.settimeout(30)
        got_bytes = 0
        while chunk := conn.recv(1 << 16):
            got_bytes += len(chunk)
        conn.close()
        listener.close()
        _, err = sender.communicate(timeout=30)
        assert sender.returncode == 0, err
        assert got_bytes == 1 << 20
        _, packets = wan.counters()[(EU, US)]
        assert packets > (1 << 20) / 1500  # segments of at most the MTU
    assert {k: wan_netns.sysctl_path(k).read_text().strip() for k in (key, cc)} == host


SEND_1MB = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as s:
    s.sendall(bytes(1 << 20))
"""


def test_a_jumbo_mtu_gets_a_receive_buffer_of_a_real_paths_segments() -> None:
    """The default scales with the MTU (45 segments either way); the maximum is never lowered."""
    from geoshard.wan.rehearsal import receive_buffer_for_mtu

    assert receive_buffer_for_mtu("4096 131072 33554432", 65000) == f"4096 {131072 * 64948 // 1448} 33554432"
    assert receive_buffer_for_mtu("4096 131072 4194304", 65000) == f"4096 {131072 * 64948 // 1448} {131072 * 64948 // 1448}"
    assert receive_buffer_for_mtu("4096 131072 33554432", 1500) is None  # a real path's MTU: the kernel's own
    assert receive_buffer_for_mtu("4096 8388608 33554432", 9001) is None  # already as large
    assert receive_buffer_for_mtu("garbled", 65000) is None


@needs_root
def test_the_rehearsals_namespaces_scale_the_receive_buffer_unless_told() -> None:
    key = "net.ipv4.tcp_rmem"
    m = parse_matrix(matrix_text(5.0, regions=(US, EU)), source="m.toml")
    with Rehearsal(m, measure_ceiling=False) as wan:
        _low, default, high = (int(x) for x in wan_netns.get_sysctl(wan.netns(US), key).split())
        assert default >= 5_000_000 and high >= default
    with Rehearsal(m, measure_ceiling=False, mtu=1500) as wan:
        assert int(wan_netns.get_sysctl(wan.netns(EU), key).split()[1]) < 1_000_000
    with Rehearsal(m, measure_ceiling=False, sysctls={key: "4096 262144 8388608"}) as wan:
        assert wan_netns.get_sysctl(wan.netns(EU), key).split() == ["4096", "262144", "8388608"]
