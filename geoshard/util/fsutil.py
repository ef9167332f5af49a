"""Files replaced whole: a temporary file beside the target, fsync, rename."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def temp_file(folder: Path, prefix: str, suffix: str) -> tuple[int, str]:
    """A new file in ``folder`` to write and rename into place, open for writing: (fd, path).

    Unlike ``tempfile.mkstemp`` (always 0600) it gets the mode any new file gets, 0666 less the
    umask, so what lands by rename is readable by whom the umask allows (a replica served to the
    ``User=geoshard`` of docs/cron.md)."""
    for _ in range(100):
        name = os.path.join(folder, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free temporary name for {prefix}*{suffix}")


def write_atomic(path: str | Path, data: bytes, sync_dir: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see either the old or the new file, never a part.

    ``sync_dir`` also makes the rename durable (fsync of the folder) before returning."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        dfd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
