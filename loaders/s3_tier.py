"""A region's bucket (or another region's, read cross-region) as a tier: pooled boto3 client,
short timeouts, one attempt per call (the chain owns retries and cooldowns)."""

from __future__ import annotations

from typing import Any

from geoshard.loaders.tier import TierError, TierMissing

from geoshard.endpoints import display_endpoint

_MISSING = ("NoSuchKey", "404", "NotFound", "NoSuchBucket")


class S3Tier:
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
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix, self.endpoint, self.region = bucket, prefix.strip("/"), endpoint, region
        self.name = name or f"s3:{region or bucket}"
        session = boto3.session.Session(profile_name=profile) if profile else boto3.session.Session()
        self.client: Any = session.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(
                connect_timeout=min(timeout_s, 5.0),
                read_timeout=timeout_s,
                retries={"max_attempts": 1, "mode": "standard"},
                max_pool_connections=16,
            ),
        )

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def _fail(self, path: str, e: Exception) -> TierError:
        from botocore.exceptions import ClientError

        where = f"{self.name} (s3://{self.bucket}/{self._key(path)} at {display_endpoint(self.endpoint)})"
        if isinstance(e, ClientError):
            code = str(e.response.get("Error", {}).get("Code", "?"))
            if code in _MISSING:
                return TierMissing(f"{where}: {code}")
            return TierError(f"{where}: {code}")
        return TierError(f"{where}: {type(e).__name__}")

    def stat(self, path: str) -> int | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(path))["ContentLength"])
        except (ClientError, BotoCoreError) as e:
            err = self._fail(path, e)
            if isinstance(err, TierMissing):
                return None
            raise err from e

    def _get(self, path: str, **kw: Any) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(path), **kw)["Body"]
            with body:
                data: bytes = body.read()
            return data
        except (ClientError, BotoCoreError) as e:
            raise self._fail(path, e) from e

    def read(self, path: str) -> bytes:
        return self._get(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return self._get(path, Range=f"bytes={offset}-{offset + length - 1}")
