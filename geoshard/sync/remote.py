"""A region's bucket as geoshard uses it: listing, manifests, checks, deletes, multipart cleanup.

Bulk transfers go through s5cmd (``geoshard.sync.s5cmd``); this module does the few small,
ordered requests around them with boto3, one pooled client per region.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from geoshard.errors import ConfigError, StorageError
from geoshard.manifest.lease import HISTORY as HISTORY  # re-exported: its import path before leases
from geoshard.plan import Region
from geoshard.s3 import REQUEST_TIMEOUT_S, classify, s3_client
from geoshard.util.endpoints import display_endpoint
from geoshard.util.hashing import new as new_hash

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
_PAGE = 1000  # keys per LIST page (the S3 maximum)


class MissingBucket(StorageError):
    """The region's bucket does not exist."""


@dataclass(frozen=True)
class RemoteObject:
    key: str
    size: int
    etag: str  # without quotes


@dataclass(frozen=True)
class BucketTarget:
    """Where a region's shards live: ``s3://bucket/prefix`` at an endpoint."""

    region: str
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty
    endpoint: str | None
    profile: str | None

    @classmethod
    def of(cls, region: Region, default_endpoint: str | None) -> BucketTarget:
        if not region.bucket_name:
            raise ConfigError(f"regions.{region.name}.bucket: not set; sync needs a bucket for every region it publishes")
        return cls(region.name, region.bucket_name, region.bucket_prefix, region.endpoint or default_endpoint, region.profile)

    def key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(path)}" if path else f"s3://{self.bucket}/{self.prefix}"

    @property
    def where(self) -> str:
        return f"{self.url()} at {display_endpoint(self.endpoint)}"


class Bucket:
    """Small ordered operations on one region's bucket (boto3, errors named by bucket and endpoint)."""

    def __init__(self, target: BucketTarget, client: Any = None, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.target = target
        self.client = client if client is not None else s3_client(target.endpoint, target.profile, target.region, timeout_s)

    def _fail(self, what: str, e: Exception) -> StorageError:
        f = classify(e)
        if f.bucket_missing:
            return MissingBucket(f"{self.target.where}: bucket does not exist; create it or pass --create-buckets")
        if f.code == "NoCredentials":
            return StorageError(
                f"{self.target.where}: no AWS credentials found; set the AWS_* variables or regions.{self.target.region}.profile"
            )
        if not f.answered:
            return StorageError(f"{self.target.where}: {what} failed: cannot reach the endpoint ({f.code})")
        return StorageError(f"{self.target.where}: {what} failed: {f.describe()}")

    def _call(self, what: str, fn: Any, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kw)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(what, e) from e

    def ensure_bucket(self, create: bool) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.target.bucket)
            return
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "?")
            if code not in ("404", "NoSuchBucket") or not create:
                if code in ("404", "NoSuchBucket"):
                    raise MissingBucket(f"{self.target.where}: bucket does not exist; create it or pass --create-buckets") from e
                raise self._fail("HEAD bucket", e) from e
        except BotoCoreError as e:
            raise self._fail("HEAD bucket", e) from e
        log.info("creating bucket %s", self.target.bucket)
        self._call("create bucket", self.client.create_bucket, Bucket=self.target.bucket)

    def get(self, path: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.target.bucket, Key=self.target.key(path))["Body"]
            with body:
                data: bytes = body.read()
            return data
        except ClientError as e:
            if classify(e).kind == "missing":
                return None
            raise self._fail(f"GET {path}", e) from e
        except BotoCoreError as e:
            raise self._fail(f"GET {path}", e) from e

    def digest(self, path: str, algorithm: str) -> str | None:
        """The hex digest of the object's bytes, streamed (``--verify-remote``); None when absent."""
        from botocore.exceptions import BotoCoreError, ClientError

        h = new_hash(algorithm)
        try:
            body = self.client.get_object(Bucket=self.target.bucket, Key=self.target.key(path))["Body"]
            with body:
                for chunk in body.iter_chunks(1 << 20):
                    h.update(chunk)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._fail(f"GET {path}", e) from e
        except BotoCoreError as e:
            raise self._fail(f"GET {path}", e) from e
        return str(h.hexdigest())

    def put(self, path: str, data: bytes, content_type: str = "application/json") -> None:
        self._call(
            f"PUT {path}", self.client.put_object, Bucket=self.target.bucket, Key=self.target.key(path), Body=data, ContentType=content_type
        )

    def listing(self, hints: Sequence[str] = ()) -> dict[str, RemoteObject]:
        """Every object under the prefix, keyed by its path relative to the prefix.

        A listing is a chain of pages, one round trip each. ``hints`` (sorted paths expected under
        the prefix, e.g. a manifest's) cut the key space into ranges listed in parallel, so 10,000
        objects on a 150 ms link take a couple of round trips instead of ten.
        """
        prefix = f"{self.target.prefix}/" if self.target.prefix else ""
        bounds = [prefix + h for h in sorted(hints)[_PAGE::_PAGE]]
        ranges = list(zip([None, *bounds], [*bounds, None], strict=True))
        with ThreadPoolExecutor(max_workers=min(len(ranges), 16)) as pool:
            parts = list(pool.map(lambda r: self._list_range(prefix, r[0], r[1]), ranges))
        out = {}
        for part in parts:
            for obj in part:
                out[obj.key[len(prefix) :]] = obj
        return out

    def _list_range(self, prefix: str, after: str | None, upto: str | None) -> list[RemoteObject]:
        """Objects with ``after < key <= upto`` (open ends when None)."""
        kw: dict[str, Any] = {"Bucket": self.target.bucket, "Prefix": prefix}
        if after is not None:
            kw["StartAfter"] = after
        found: list[RemoteObject] = []
        while True:
            page = self._call("LIST", self.client.list_objects_v2, **kw)
            for obj in page.get("Contents", []):
                if upto is not None and obj["Key"] > upto:
                    return found
                found.append(RemoteObject(obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")).strip('"')))
            if not page.get("IsTruncated"):
                return found
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def head(self, path: str) -> RemoteObject | None:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.target.key(path)
        try:
            r = self.client.head_object(Bucket=self.target.bucket, Key=key)
        except ClientError as e:
            if classify(e).kind == "missing":
                return None
            raise self._fail(f"HEAD {path}", e) from e
        except BotoCoreError as e:
            raise self._fail(f"HEAD {path}", e) from e
        return RemoteObject(key, int(r["ContentLength"]), str(r.get("ETag", "")).strip('"'))

    def delete(self, paths: Iterable[str]) -> int:
        keys = [self.target.key(p) for p in paths]
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            r = self._call(
                "DELETE objects", self.client.delete_objects, Bucket=self.target.bucket, Delete={"Objects": batch, "Quiet": True}
            )
            if r.get("Errors"):
                first = r["Errors"][0]
                raise StorageError(f"{self.target.where}: deleting {first.get('Key')} failed: {first.get('Code')}")
        return len(keys)

    def stale_multipart_uploads(self, before: datetime) -> Iterator[tuple[str, str]]:
        """(key, upload id) of multipart uploads under the prefix started before ``before``."""
        prefix = f"{self.target.prefix}/" if self.target.prefix else ""
        kw: dict[str, Any] = {"Bucket": self.target.bucket, "Prefix": prefix}
        while True:
            r = self._call("LIST multipart uploads", self.client.list_multipart_uploads, **kw)
            for u in r.get("Uploads", []):
                initiated = u.get("Initiated")
                if initiated is None or initiated < before:
                    yield u["Key"], u["UploadId"]
            if not r.get("IsTruncated"):
                return
            kw.update(KeyMarker=r.get("NextKeyMarker"), UploadIdMarker=r.get("NextUploadIdMarker"))

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._call(
            f"abort multipart upload of {key}", self.client.abort_multipart_upload, Bucket=self.target.bucket, Key=key, UploadId=upload_id
        )
