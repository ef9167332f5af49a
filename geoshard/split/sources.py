"""Turning SOURCE arguments into a sorted list of input files, and opening them as byte streams.

A SOURCE is a file, a folder (searched recursively for shards), a glob, a brace pattern such as
``train-{000..099}.tar``, or an ``s3://bucket/key`` URL (a key, a prefix, or a glob in the key).
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import gzip
import io
import logging
import os
import re
import stat
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from geoshard import s3 as s3lib
from geoshard.errors import ConfigError, DataError, StorageError
from geoshard.formats import Format, detect_format, format_of_name, is_gzip_name
from geoshard.formats._window import Readable
from geoshard.s3 import REQUEST_TIMEOUT_S, s3_client
from geoshard.util.hashing import FAST
from geoshard.util.hashing import new as new_hash

log = logging.getLogger(__name__)
_GLOB = re.compile(r"[*?\[]")
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


@dataclass(frozen=True)
class SourceRef:
    url: str  # absolute local path or s3:// URL
    size: int
    format: Format
    gzip: bool


@dataclass(frozen=True)
class S3Access:
    """Where to reach S3 for each bucket; credentials stay with the AWS SDK's own chain."""

    default_endpoint: str | None = None
    buckets: tuple[tuple[str, str | None, str | None], ...] = ()  # (bucket, endpoint, profile)
    regions: tuple[tuple[str, str], ...] = ()  # (bucket, plan region): the client's region_name
    timeout_s: float = REQUEST_TIMEOUT_S

    def for_bucket(self, bucket: str) -> tuple[str | None, str | None]:
        for name, endpoint, profile in self.buckets:
            if name == bucket:
                return endpoint or self.default_endpoint, profile
        return self.default_endpoint, None

    def region_of(self, bucket: str) -> str | None:
        return dict(self.regions).get(bucket)


def braceexpand(pattern: str) -> list[str]:
    """Expand ``{a,b}`` alternatives and zero-padded ``{000..099}`` ranges, left to right."""
    m = _RANGE.search(pattern)
    alt = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if m and (alt is None or m.start() < alt.start()):
        lo, hi = m.group(1), m.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1
        out: list[str] = []
        for i in range(int(lo), int(hi) + step, step):
            out.extend(braceexpand(pattern[: m.start()] + str(i).zfill(width) + pattern[m.end() :]))
        return out
    if alt:
        return [x for choice in alt.group(1).split(",") for x in braceexpand(pattern[: alt.start()] + choice + pattern[alt.end() :])]
    return [pattern]


def _sniff(path: str, fmt: Format | None) -> tuple[Format, bool]:
    gz = is_gzip_name(path)
    named = format_of_name(path)
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        raise DataError(f"{path}: cannot read source ({e.strerror}); fix its permissions or leave it out of SOURCE") from e
    if head[:2] == b"\x1f\x8b":
        gz = True
    else:
        named = detect_format(head) or named
    found = fmt or named
    if found is None:
        raise ConfigError(f"{path}: cannot tell the format; name it .tar, .tfrecord or .tfrecord.gz, or pass --format")
    return found, gz


def expand_sources(args: Sequence[str], fmt: Format | None = None, s3: S3Access | None = None) -> list[SourceRef]:
    """Resolve every SOURCE; the result is sorted, deduplicated, and all of one format."""
    if not args:
        raise ConfigError("no SOURCE given; pass files, folders, globs or s3:// URLs")
    refs: dict[str, SourceRef] = {}
    for arg in args:
        matched = 0
        for pattern in braceexpand(arg):
            found = _expand_s3(pattern, fmt, s3 or S3Access()) if pattern.startswith("s3://") else _expand_local(pattern, fmt)
            for ref in found:
                refs[ref.url] = ref
                matched += 1
        if matched == 0:
            raise ConfigError(f"{arg}: source not found (no file, folder or object matches)")
    out = sorted(refs.values(), key=lambda r: r.url)
    formats = {r.format for r in out}
    if len(formats) > 1:
        raise ConfigError(f"sources mix formats ({', '.join(sorted(formats))}); split one format at a time")
    for r in out:
        if r.size == 0:
            raise DataError(f"{r.url}: empty source file")
    return out


def refuse_out_inside(args: Sequence[str], out: str | os.PathLike[str]) -> None:
    """Refuse an output folder that a SOURCE folder (or a ``**`` glob) reaches: the split would
    succeed once, then read its own shards next time and fail on every key as a duplicate."""
    target = os.path.realpath(out)
    for arg in args:
        for pattern in braceexpand(arg):
            if pattern.startswith("s3://"):
                continue
            parts = pattern.split(os.sep)
            fixed = next((i for i, p in enumerate(parts) if _GLOB.search(p)), None)
            if fixed is not None and "**" not in parts[fixed:]:
                continue  # a glob without ** reaches only as deep as it names
            base = pattern if fixed is None else os.sep.join(parts[:fixed]) or ("/" if pattern.startswith(os.sep) else ".")
            if not os.path.isdir(base):
                continue
            root = os.path.realpath(base)
            if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
                raise ConfigError(
                    f"--out {out}: inside the source folder {arg}; the next split would read its shards; choose a folder outside it"
                )


def _expand_local(pattern: str, fmt: Format | None) -> list[SourceRef]:
    if _GLOB.search(pattern):
        _check_listable(pattern)
        paths = sorted(glob.glob(pattern, recursive=True))
        paths = [p for p in paths if os.path.isfile(p)]
    elif os.path.isdir(pattern):
        paths = _walk(pattern)
    elif os.path.isfile(pattern):
        paths = [pattern]
    elif os.path.lexists(pattern):
        raise ConfigError(f"{pattern}: {_not_a_file(pattern)}; a SOURCE is a regular file, a folder or a glob")
    else:
        return []
    out = []
    for p in paths:
        ap = os.path.abspath(p)
        f, gz = _sniff(ap, fmt)
        out.append(SourceRef(url=ap, size=os.path.getsize(ap), format=f, gzip=gz))
    return out


def _not_a_file(path: str) -> str:
    """What ``path`` is when it exists but is no regular file or folder (a source is read twice, so
    a FIFO or a device cannot be one)."""
    prefix = ""
    if os.path.islink(path):
        prefix = f"a symbolic link to {os.readlink(path)}, "
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            return prefix + ("which loops back on itself" if e.errno == errno.ELOOP else "which does not exist")
    else:
        mode = os.lstat(path).st_mode
    kinds = [(stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    kinds.append((stat.S_ISSOCK, "a socket"))
    return prefix + next((what for test, what in kinds if test(mode)), "not a regular file")


def _check_listable(pattern: str) -> None:
    """glob skips folders it cannot list without a word; refuse them instead, down to the depth
    the pattern can reach (every depth with ``**``)."""
    parts = pattern.split(os.sep)
    fixed = next(i for i, p in enumerate(parts) if _GLOB.search(p))
    base = os.sep.join(parts[:fixed]) or ("/" if pattern.startswith(os.sep) else ".")
    depth = None if "**" in parts[fixed:] else len(parts) - fixed - 1
    if not os.path.isdir(base):
        return
    for top, dirs, _ in os.walk(base, onerror=_refuse):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if depth is not None and top.count(os.sep) - base.rstrip(os.sep).count(os.sep) >= depth:
            dirs[:] = []


def _refuse(e: OSError) -> None:
    raise DataError(f"{e.filename}: cannot list source folder ({e.strerror}); fix its permissions or leave it out of SOURCE")


def _walk(folder: str) -> list[str]:
    """The shards under a folder; manifests and hidden temp files are not inputs.

    A subfolder that cannot be listed is an error, not a silent gap: skipping it would publish
    part of the corpus as if it were the whole."""

    found = []
    for top, dirs, files in os.walk(folder, onerror=_refuse):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(top, f) for f in files if not f.startswith(".") and format_of_name(f)]
    return sorted(p for p in found if os.path.isfile(p))


def split_s3_url(url: str) -> tuple[str, str]:
    rest = url[5:]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{url}: an s3 URL needs a bucket: s3://bucket/key")
    return bucket, key


def _s3_failure(url: str, endpoint: str | None, e: Exception) -> StorageError:
    f = s3lib.classify(e)
    where = endpoint or "the default AWS endpoint"
    if f.kind == "transient":
        return StorageError(f"{url}: cannot reach S3 at {where}: {f.code}")
    return StorageError(f"{url}: S3 error {f.describe()} at {where}")


def _expand_s3(pattern: str, fmt: Format | None, s3: S3Access) -> list[SourceRef]:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3_url(pattern)
    endpoint, profile = s3.for_bucket(bucket)
    client = s3_client(endpoint, profile, s3.region_of(bucket), s3.timeout_s)
    wild = _GLOB.search(key)
    prefix = key[: wild.start()] if wild else key
    out = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                k = obj["Key"]
                if wild and not fnmatch.fnmatchcase(k, key):
                    continue
                if not wild and k != key and not (k.startswith(key.rstrip("/") + "/") or key == ""):
                    continue
                f = fmt or format_of_name(k)
                if f is None:
                    if k == key:
                        raise ConfigError(f"s3://{bucket}/{k}: cannot tell the format; name it .tar or .tfrecord, or pass --format")
                    continue
                out.append(SourceRef(url=f"s3://{bucket}/{k}", size=int(obj["Size"]), format=f, gzip=is_gzip_name(k)))
    except (ClientError, BotoCoreError) as e:
        raise _s3_failure(pattern, endpoint, e) from e
    return out


class HashingReader:
    """Counts and hashes every byte read through it (the manifest records each source).

    xxh3-128 by default: the record only tells an incremental split whether a source changed, so
    it needs no cryptographic pass (the shards written from it carry sha256); sha256 still checks
    sources of manifests written before (``hash_source``)."""

    def __init__(self, raw: Readable, algorithm: str = FAST) -> None:
        self.raw = raw
        self.hasher = new_hash(algorithm)
        self.size = 0

    def read(self, n: int = -1, /) -> bytes:
        data = self.raw.read(n)
        self._count(memoryview(data))
        return data

    def readinto(self, into: memoryview, /) -> int:
        """As ``read``, into the caller's buffer (the split's reused window: one copy less)."""
        readinto = getattr(self.raw, "readinto", None)
        if readinto is None:  # an S3 body
            data = self.raw.read(len(into))
            n = len(data)
            into[:n] = data
        else:
            n = readinto(into) or 0
        self._count(into[:n])
        return n

    def _count(self, view: memoryview) -> None:
        for i in range(0, len(view), 1 << 20):  # cache-sized pieces hash ~15% faster than one 4 MB call
            self.hasher.update(view[i : i + (1 << 20)])
        self.size += len(view)

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()  # type: ignore[no-any-return]

    def seek(self, n: int, /) -> int:
        raise io.UnsupportedOperation("sources are read once, front to back")

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


@contextmanager
def open_source(ref: SourceRef, s3: S3Access, algorithm: str = FAST) -> Iterator[tuple[Readable, HashingReader]]:
    """Yield (decoded stream, hashing reader over the stored bytes, hashing with ``algorithm``)."""
    if ref.url.startswith("s3://"):
        from botocore.exceptions import BotoCoreError, ClientError  # only here: a local split imports no botocore

        bucket, key = split_s3_url(ref.url)
        endpoint, profile = s3.for_bucket(bucket)
        try:
            body = s3_client(endpoint, profile, s3.region_of(bucket), s3.timeout_s).get_object(Bucket=bucket, Key=key)["Body"]
        except (ClientError, BotoCoreError) as e:
            raise _s3_failure(ref.url, endpoint, e) from e
        raw: Any = body
    else:
        try:
            raw = open(ref.url, "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise DataError(f"{ref.url}: cannot open source: {e.strerror}") from e
    hashing = HashingReader(raw, algorithm)
    try:
        if ref.gzip:
            with gzip.GzipFile(filename=None, mode="rb", fileobj=hashing) as gz:
                yield gz, hashing
        else:
            yield hashing, hashing
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{ref.url}: corrupt or truncated gzip stream ({e})") from e
    finally:
        raw.close()


def hash_source(ref: SourceRef, s3: S3Access, algorithm: str = FAST) -> str:
    """A digest of a source's stored bytes (an incremental split compares it with the manifest)."""
    with open_source(ref, s3, algorithm) as (_, reader):
        reader.drain()
        return reader.hexdigest()
