"""Helpers for the guarantee tests (docs/guarantees.md): the real ``geoshard`` command in a
subprocess, the one-line error check, and snapshots proving nothing outside a target changed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))


@dataclass(frozen=True)
class Run:
    rc: int
    out: str
    err: str
    seconds: float


def geoshard(
    *args: object, cwd: Path | None = None, timeout: float = 180, prefix: Sequence[str] = (), env: dict[str, str] | None = None
) -> Run:
    """Run ``geoshard ARGS`` as a user would; ``prefix`` wraps it (setpriv, unshare)."""
    environ = dict(os.environ)
    environ.pop("PYTHONPATH", None)
    environ.update(env or {})
    t0 = time.monotonic()
    p = subprocess.run(
        [*prefix, GEOSHARD, *(str(a) for a in args)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=environ, check=False
    )
    return Run(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


def assert_one_line(r: Run, code: int, *words: str) -> str:
    """Exit ``code``, exactly one stderr line ``geoshard: error: ...`` holding ``words``, no traceback."""
    assert r.rc == code, (r.rc, r.err[-3000:])
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("geoshard: error: "), r.err[-3000:]
    assert "Traceback" not in r.err + r.out and "distributed.worker" not in r.err, r.err[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int, bool]]:
    """Every path under ``root`` (but ``skip``) with size, mtime and whether it is a folder."""
    out = {}
    for top, dirs, files in os.walk(root):
        if skip is not None and Path(top) == skip:
            dirs[:] = []
            continue
        for n in [*dirs, *files]:
            p = Path(top, n)
            if skip is not None and p == skip:
                continue
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, p.is_dir())
    return out


def published(out: Path) -> list[str]:
    """Manifests and shards under a split folder (nothing, when a split failed)."""
    if not out.exists():
        return []
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".tar", ".tfrecord"))


def as_user(tmp: Path) -> tuple[list[str], dict[str, str]]:
    """A prefix running the command without the capabilities that let root read and write anything.

    The uid stays, so the command can still run from a checkout only root may enter (a home folder,
    a ``mktemp -d`` folder): an empty bounding set and no inheritable or ambient capabilities give
    an exec'd root process none, so file permissions apply to it as to any user."""
    env = {"HOME": str(tmp), "TMPDIR": str(tmp)}
    if os.getuid() != 0:
        return [], env
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--"], env


class BlackHole:
    """A TCP endpoint on 127.0.0.1 that accepts connections and never answers (nor closes them)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.held: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.held.append(conn)

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        for c in self.held:
            c.close()
        self.sock.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
