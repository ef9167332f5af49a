"""Training checkpoints: written atomically to a local folder or an S3 prefix, found again on resume.

Layout under the target (``/ckpt/run1`` or ``s3://bucket/run1``)::

    ckpt-000001000.pt   torch.save bytes of the state the trainer passed
    latest.json         {"step", "path", "sha256", "bytes", "previous": [older kept entries]}

A checkpoint lands whole (a temporary file fsynced and renamed over, or one S3 PUT) before
``latest.json`` moves to it the same way, so a crash or failure at any point leaves the previous
pointer and its checkpoint intact. ``path`` is relative to the target, so a copied folder or
bucket still resumes. ``previous`` carries the older kept checkpoints' hashes: when the newest
fails its sha256, loading falls back to them. Older checkpoints are deleted only after the pointer
moved. Checkpoint files are never dropped for want of a pointer: with ``latest.json`` missing or
malformed, loading resumes from the newest file that loads (or refuses), and the next save keeps
the newest of them as the pointer's ``previous``.

Only rank 0 may call ``save`` (the trainer decides; two writers would race on the pointer). Any
rank may call ``load_latest``, which only reads; with a local target that needs a filesystem every
node sees, otherwise rank 0 loads and broadcasts.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from geoshard import s3
from geoshard.errors import ConfigError, DataError, StorageError
from geoshard.loaders.elastic import region_states
from geoshard.util.endpoints import display_endpoint
from geoshard.util.fsutil import write_atomic
from geoshard.util.retry import Backoff, retry

log = logging.getLogger(__name__)
T = TypeVar("T")

POINTER = "latest.json"
_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_S3_PUT_LIMIT = 5 * 1024**3  # one PUT is atomic; above this S3 needs a multipart upload
_POINTER_LIMIT = 1024**2  # a pointer names a few checkpoints; anything larger is not one


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def loader_position(states: Any, region: str, rank: int) -> Any:
    """What a rank's loader resumes from, out of a checkpoint's ``loaders`` (every rank's state, keyed
    by region and rank in it): all of its region's states (``region_states``), which resume as
    saved on the same ranks and re-striped on others; a region the checkpoint lacks begins the
    job's epoch. A checkpoint of a single-region version holds a list by global rank."""
    if isinstance(states, list):
        return states[rank]
    return region_states(states.values(), region)


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    path: str  # relative to the target
    sha256: str
    size: int  # "bytes" in latest.json

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "sha256": self.sha256, "bytes": self.size}

    @classmethod
    def from_json(cls, d: Any) -> CheckpointEntry:
        entry = cls(step=d["step"], path=d["path"], sha256=d["sha256"], size=d["bytes"])
        name = _NAME.match(str(entry.path))
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (entry.step, entry.size))
        if not (ints and name and int(name.group(1)) == entry.step and isinstance(entry.sha256, str)):
            raise ValueError(f"bad entry {str(d)[:200]}")
        return entry


class _Transient(Exception):
    """A retryable S3 failure, its message already free of anything secret."""


class _MalformedPointer(StorageError):
    def __init__(self, where: str, detail: str) -> None:
        self.reason = f"{POINTER} is malformed ({detail})"
        super().__init__(f"{where}: {self.reason}; fix or remove it")


class _LocalDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)

    def put(self, name: str, data: bytes) -> None:
        # The rename itself must survive a power cut before the pointer names the file.
        write_atomic(self.root / name, data, sync_dir=True)

    def get(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)


class _S3Prefix:
    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None, profile: str | None, region: str | None = None) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.where = f"s3://{bucket}/{self.prefix} at {display_endpoint(endpoint_url)}"
        try:
            # One attempt per call: the store's Backoff owns the retries, so they do not multiply.
            self.client: Any = s3.client(endpoint_url, profile, region, s3.Timeouts(connect_s=5, read_s=120, attempts=1))
        except ConfigError as e:
            raise ConfigError(f"{self.where}: {e}") from e

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, what: str, fn: Callable[[], T], missing_ok: bool = False) -> T | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (ClientError, BotoCoreError) as e:
            f = s3.classify(e)
            if missing_ok and f.kind == "missing":
                return None
            if f.kind == "missing" or f.kind == "permanent":
                raise StorageError(f"{self.where}: {what} failed: {f.describe()}") from e
            raise _Transient(f"{what}: S3 error {f.code}" if f.answered else f"{what}: {f.code}") from e

    def put(self, name: str, data: bytes) -> None:
        if len(data) > _S3_PUT_LIMIT:
            raise StorageError(f"{self.where}: {name} is {len(data):,} bytes, over S3's 5 GiB single-PUT limit")
        self._call(f"PUT {name}", lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data))

    def get(self, name: str) -> bytes | None:
        def fetch() -> bytes:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
            with body:
                data: bytes = body.read()
            return data

        return self._call(f"GET {name}", fetch, missing_ok=True)

    def names(self) -> list[str]:
        def listing() -> list[str]:
            start = len(self._key(""))
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key("ckpt-"))
            return [o["Key"][start:] for page in pages for o in page.get("Contents", [])]

        return self._call("LIST", listing) or []

    def delete(self, name: str) -> None:
        self._call(f"DELETE {name}", lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(name)))


class CheckpointStore:
    """Saves and loads checkpoints under ``target``: a local folder or ``s3://bucket/prefix``.

    S3 credentials come only from the AWS SDK chain (environment, ``profile``, instance role);
    ``region`` is the bucket's AWS region (see ``geoshard.s3.bucket_region``; None: the SDK's own).
    Storage calls are retried with ``backoff`` on OSError and S3 errors worth retrying; then a
    StorageError names the target.
    """

    def __init__(
        self,
        target: str,
        *,
        keep: int = 2,
        endpoint_url: str | None = None,
        profile: str | None = None,
        region: str | None = None,
        backoff: Backoff | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"checkpoint keep: must be an integer >= 1, got {keep!r}")
        if endpoint_url is not None:
            parts = urlsplit(endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{display_endpoint(endpoint_url)}: a checkpoint endpoint must be http://HOST[:PORT] or https://...")
            if parts.username is not None or parts.password is not None:
                shown = display_endpoint(endpoint_url)
                raise ConfigError(f"{shown}: remove user:password@ from the endpoint URL; pass credentials in env")
        self.keep = keep
        self.backoff = backoff or Backoff()
        self._sleep = sleep
        self._backend: _LocalDir | _S3Prefix
        if target.startswith("s3://"):
            bucket, _, prefix = target[5:].partition("/")
            if not bucket:
                raise ConfigError(f"{target}: an s3 checkpoint target needs a bucket: s3://bucket/prefix")
            self._backend = _S3Prefix(bucket, prefix, endpoint_url, profile, region)
        elif _SCHEME.match(target) or not target:
            raise ConfigError(f"{target!r}: a checkpoint target is a local folder or s3://bucket/prefix")
        else:
            if endpoint_url or profile:
                raise ConfigError(f"{target}: endpoint_url and profile apply only to an s3:// checkpoint target")
            self._backend = _LocalDir(Path(target).expanduser().absolute())

    @property
    def where(self) -> str:
        """The target as safe to print (S3: bucket, prefix and endpoint without credentials)."""
        return self._backend.where

    def is_empty(self) -> bool:
        """No pointer and no checkpoint file here (one listing)."""
        names = self._retry("listing checkpoints", self._backend.names)
        return not any(n == POINTER or _NAME.match(n) for n in names)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return retry(fn, self.backoff, (OSError, _Transient), f"{what} at {self.where}", sleep=self._sleep)
        except (OSError, _Transient) as e:
            raise StorageError(f"{self.where}: {what} failed after {self.backoff.attempts} attempts: {e}") from e

    def save(self, step: int, state: Mapping[str, Any]) -> float:
        """Write ``state`` as step ``step``, move the pointer to it, prune; returns the seconds taken.

        Only rank 0 calls this. On StorageError the previous pointer and checkpoint are untouched.
        """
        import torch

        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"checkpoint step: must be an integer >= 0, got {step!r}")
        start = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        del buf
        name = checkpoint_name(step)
        entry = CheckpointEntry(step=step, path=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        self._retry(f"writing {name}", functools.partial(self._backend.put, name, data))
        del data  # the bytes can be as large as the model; free them before the rest
        try:
            older = self._entries() or self._unpointed(step)
        except _MalformedPointer as e:
            log.warning("%s; replacing it", e)
            older = self._unpointed(step)
        # Entries at or above this step belong to an abandoned future (a resume from an older one).
        previous = [e for e in older if e.step < step][: self.keep - 1]
        pointer = {**entry.to_json(), "previous": [e.to_json() for e in previous]}
        body = (json.dumps(pointer, indent=1) + "\n").encode()
        self._retry(f"writing {POINTER}", functools.partial(self._backend.put, POINTER, body))
        self._prune({e.path for e in (entry, *previous)})
        elapsed = time.perf_counter() - start
        log.info("checkpoint step %d: %d bytes to %s in %.2f s", step, entry.size, self.where, elapsed)
        return elapsed

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint whose sha256 matches as (step, state), or None when there is none.

        Tensors load onto the CPU (load_state_dict moves them to the model's device), with
        ``weights_only=True``: the state may hold tensors and plain Python values, not objects.
        """
        try:
            entries = self._entries()
        except _MalformedPointer as e:
            return self._recover(e.reason, e)
        if not entries:
            return self._recover(f"no {POINTER}", None)
        problems = []
        for entry in entries:
            data = self._retry(f"reading {entry.path}", functools.partial(self._backend.get, entry.path))
            if data is None:
                problem = "missing"
            elif len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
                problem = f"corrupt ({len(data):,} bytes, sha256 does not match {POINTER})"
            else:
                return entry.step, self._deserialize(entry, data)
            problems.append(f"{entry.path} {problem}")
            log.warning("%s: checkpoint %s is %s; trying an older one", self.where, entry.path, problem)
        raise StorageError(f"{self.where}: no usable checkpoint: {'; '.join(problems)}")

    def _files(self) -> list[tuple[int, str]]:
        """The checkpoint files present as (step, name), newest first."""
        names = self._retry("listing checkpoints", self._backend.names)
        return sorted(((int(m.group(1)), n) for n in names if (m := _NAME.match(n))), reverse=True)

    def _recover(self, why: str, malformed: _MalformedPointer | None) -> tuple[int, dict[str, Any]] | None:
        """Without a usable pointer: the newest checkpoint file that loads; never a fresh start over
        checkpoint files. Without the pointer's sha256 a file "verifies" when it loads as a dict
        whose ``step``, if it has one, is its name's."""
        files = self._files()
        if not files:
            if malformed is not None:
                raise malformed
            return None
        problems = []
        for step, name in files:
            data = self._retry(f"reading {name}", functools.partial(self._backend.get, name))
            state, problem = (None, "missing") if data is None else self._try_load(step, name, data)
            if state is not None:
                log.warning("%s: %s; resuming from %s, the newest of %d checkpoint files that loads", self.where, why, name, len(files))
                return step, state
            problems.append(f"{name} {problem}")
        raise StorageError(
            f"{self.where}: {why}, and none of its {len(files)} checkpoint files loads ({'; '.join(problems)}); "
            f"refusing to start from scratch over them: restore {POINTER} or move them away"
        )

    def _try_load(self, step: int, name: str, data: bytes) -> tuple[dict[str, Any] | None, str]:
        """The state in ``data`` if it is a checkpoint of ``step``, else None and why not."""
        import pickle

        try:
            state = self._deserialize(CheckpointEntry(step, name, "", len(data)), data)
        except (DataError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
            return None, f"does not load ({type(e).__name__})"
        if "step" in state and state["step"] != step:
            return None, f"holds step {state['step']!r}"
        return state, ""

    def _unpointed(self, below: int) -> list[CheckpointEntry]:
        """Checkpoint files no pointer names, below ``below``, newest first, as many as the next
        pointer keeps: hashed now, so that a save after a lost pointer prunes none of them early."""
        entries: list[CheckpointEntry] = []
        for step, name in self._files():
            if step >= below or len(entries) >= self.keep - 1:
                continue
            data = self._retry(f"reading {name}", functools.partial(self._backend.get, name))
            if data is not None:
                entries.append(CheckpointEntry(step, name, hashlib.sha256(data).hexdigest(), len(data)))
        return entries

    def _deserialize(self, entry: CheckpointEntry, data: bytes) -> dict[str, Any]:
        import pickle

        import torch

        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            # The bytes are what save() wrote (the hash matched), so the state itself holds objects.
            raise DataError(
                f"{self.where}: {entry.path} holds objects that weights_only loading refuses ({e}); "
                "keep checkpoint state to tensors, numbers, strings, lists and dicts"
            ) from e
        if not isinstance(state, dict):
            raise DataError(f"{self.where}: {entry.path} holds a {type(state).__name__}, not a dict")
        return state

    def _entries(self) -> list[CheckpointEntry]:
        """The pointer's checkpoints, newest first; [] when there is no pointer."""
        raw = self._retry(f"reading {POINTER}", functools.partial(self._backend.get, POINTER))
        if raw is None:
            return []
        try:
            if len(raw) > _POINTER_LIMIT:
                raise ValueError(f"{len(raw):,} bytes")
            d = json.loads(raw)
            return [CheckpointEntry.from_json(d), *(CheckpointEntry.from_json(p) for p in d.get("previous", []))]
        except RecursionError:
            raise _MalformedPointer(self.where, "nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _MalformedPointer(self.where, str(e)[:200]) from e

    def _prune(self, kept: set[str]) -> None:
        # Best effort: the checkpoint already landed, and the next save prunes what this one missed.
        try:
            names = self._retry("listing checkpoints", self._backend.names)
            for name in names:
                stale = (_NAME.match(name) and name not in kept) or (name.startswith(".") and name.endswith(".partial"))
                if stale:
                    self._retry(f"deleting {name}", functools.partial(self._backend.delete, name))
        except StorageError as e:
            log.warning("%s; old checkpoints stay until the next save", e)
