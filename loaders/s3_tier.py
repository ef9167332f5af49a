"""A region's bucket (or another region's, read cross-region) as a tier: pooled boto3 client,
short timeouts, one attempt per call (the chain owns retries and cooldowns)."""

from __future__ import annotations

from typing import Any

from geoshard import s3
from geoshard.loaders.tier import Progress, TierDefaults, TierError, TierMissing
from geoshard.util.endpoints import display_endpoint

_PIECE = 256 << 10


class S3Tier(TierDefaults):
    kind = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint: str | None = None,
        profile: str | None = None,
        region: str = "",
        timeout_s: float = 30.0,
        name: str | None = None,
    ) -> None:
        self.bucket, self.prefix, self.endpoint, self.region = bucket, prefix.strip("/"), endpoint, region
        self.name = name or f"s3:{region or bucket}"
        timeouts = s3.Timeouts(connect_s=min(timeout_s, 5.0), read_s=timeout_s, attempts=1, pool=16)
        self.client: Any = s3.client(endpoint, profile, region, timeouts)

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def _fail(self, path: str, e: Exception) -> TierError:
        where = f"{self.name} (s3://{self.bucket}/{self._key(path)} at {display_endpoint(self.endpoint)})"
        f = s3.classify(e)
        if f.kind == "missing":
            return TierMissing(f"{where}: {f.code}")
        return TierError(f"{where}: {f.describe()}")  # a missing bucket is an error to see, not a miss

    def stat(self, path: str) -> int | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(path))["ContentLength"])
        except (ClientError, BotoCoreError) as e:
            err = self._fail(path, e)
            if isinstance(err, TierMissing):
                return None
            raise err from e

    def _get(self, path: str, progress: Progress | None = None, **kw: Any) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(path), **kw)["Body"]
            with body:
                if progress is None:
                    data: bytes = body.read()
                    return data
                parts = []
                while part := body.read(_PIECE):
                    parts.append(part)
                    progress(len(part))
            return b"".join(parts)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(path, e) from e

    def read(self, path: str) -> bytes:
        return self._get(path)

    def read_range(self, path: str, offset: int, length: int, progress: Progress | None = None) -> bytes:
        """``length`` bytes from ``offset``; ``progress(n)`` is called as each part of the body
        arrives (the rank's fetch queue lets the next request start before this one ends)."""
        if length <= 0:
            return b""
        return self._get(path, progress, Range=f"bytes={offset}-{offset + length - 1}")

    def put(self, path: str, data: bytes) -> None:
        """A small object (a job's lease): the one kind of write a loader makes to a bucket."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(path, e) from e
