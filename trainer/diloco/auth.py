"""The job's secret and what it signs: every value in the outer store carries an HMAC-SHA256 over
the key's name (which holds the round) and the bytes, so a value set by anyone outside the job, or
replayed under another key, is refused; refusals are counted and each kind is logged once.

The secret travels out of band: ``geoshard train`` writes 32 random bytes to a file only its user
can read (``RUN_DIR/.outer-secret``) and hands the ranks its path; with your own torchrun per region,
``--outer-secret-file`` (or ``GEOSHARD_OUTER_SECRET_FILE``) names a file you copied to every node.
The secret itself is never an argument, an environment variable, a log line or a report field.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections import Counter
from pathlib import Path

from geoshard.errors import ConfigError, DataError

log = logging.getLogger(__name__)

SECRET_BYTES = 32  # what the launcher generates
MIN_SECRET_BYTES = 16  # what a user's own file must hold at least
KEY_FILE = ".outer-secret"  # in RUN_DIR, written by the launcher
_MAC_HEX = 64  # hex digits of an HMAC-SHA256
_CONTEXT = b"geoshard-diloco-v1\0"
_SEEN_MAX = 100_000  # refused values remembered (their digests), so memory stays bounded


class Refused(DataError):
    """A value read from the store that is not used: ``kind`` (unauthenticated, malformed,
    non-finite) and ``reason`` in words. The exchange leaves the value out and goes on."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason


def write_secret(folder: Path) -> Path:
    """The launcher's secret for one launch of the job: 32 random bytes in a file only its user
    can read (any older one replaced)."""
    path = folder / KEY_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(SECRET_BYTES))
    return path


def read_secret(path: str | Path) -> bytes:
    """The secret in ``path``; ConfigError naming the file when it is missing, short, or readable by others."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"--outer-secret-file {p}: cannot read it ({e.strerror})") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"--outer-secret-file {p}: others can read it (mode {stat.S_IMODE(mode):o}); chmod 600 {p}")
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"--outer-secret-file {p}: {len(data)} bytes; the secret must hold at least {MIN_SECRET_BYTES} "
            f"(head -c {SECRET_BYTES} /dev/urandom > {p})"
        )
    return data


class Signer:
    """Signs and opens the store's values with the job's secret; counts what it refuses."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"DiLoCo: the job's secret must hold at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = secret
        self.refused: Counter[str] = Counter()  # distinct values, by kind, since the leader joined
        self._warned: set[str] = set()
        self._seen: set[tuple[str, str]] = set()  # a value read again while waiting is counted once

    def __repr__(self) -> str:
        return "Signer(<secret>)"

    def mac(self, key: str, payload: bytes | memoryview) -> str:
        # fed in two parts: a tensor's bytes (gigabytes at 10^9 parameters) are hashed in place, not copied
        h = hmac.new(self._secret, _CONTEXT + key.encode() + b"\0", hashlib.sha256)
        h.update(payload)
        return h.hexdigest()

    def sign(self, key: str, payload: bytes) -> bytes:
        """``payload`` as stored under ``key``: its MAC in hex, ':', then the payload."""
        return self.mac(key, payload).encode() + b":" + payload

    def open(self, key: str, value: bytes) -> bytes:
        """The payload of a value signed for ``key``; Refused otherwise."""
        mac, sep, payload = bytes(value).partition(b":")
        if len(mac) != _MAC_HEX or not sep:
            raise Refused("unauthenticated", "no signature")
        if not hmac.compare_digest(mac, self.mac(key, payload).encode()):
            raise Refused("unauthenticated", "its signature does not match the job's secret")
        return payload

    def check_mac(self, key: str, payload: bytes | memoryview, mac: str) -> None:
        if not hmac.compare_digest(mac.encode(), self.mac(key, payload).encode()):
            raise Refused("unauthenticated", "its bytes do not match their signature")

    def refuse(self, key: str, why: Refused, raw: bytes = b"", *, log_it: bool = True) -> None:
        """Count a refused value once; the first of each kind is logged with its key and reason
        (``log_it`` False: the caller says more in its own line)."""
        seen = (key, hashlib.sha256(bytes(raw)).hexdigest())
        if seen in self._seen:
            return
        if len(self._seen) < _SEEN_MAX:
            self._seen.add(seen)
        self.refused[why.kind] += 1
        if log_it and why.kind not in self._warned:
            self._warned.add(why.kind)
            log.warning(
                "DiLoCo: refused %s from the outer store (%s: %s); further %s values are counted in the rounds file, not logged",
                key,
                why.kind,
                why.reason,
                why.kind,
            )

    def total(self) -> int:
        return sum(self.refused.values())
