"""How geoshard talks to S3: one client factory and one reading of what an error means.

Every S3 client (sources, sync, probe, the loaders' S3 tier, checkpoints) is built here, with the
bucket's region as ``region_name`` (on AWS a client signed for the wrong region gets 301/400
answers, and one without a region pays a redirect per bucket) and bounded connect and read
timeouts. Every boto3 error is classified here, the same way for all of them:

- ``missing``: the object is not there (``NoSuchKey``, 404); a reader tries elsewhere or treats it
  as absent.
- ``permanent``: no retry fixes it; the message carries a remedy (credentials, policy, bucket
  name, region).
- ``transient``: worth retrying (timeouts, lost connections, throttling, 5xx).

The loaders and the trainer may import this module: it needs boto3 and nothing of the pipeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from geoshard.errors import ConfigError

Kind = Literal["missing", "permanent", "transient"]

# us-east-1, eu-west-2, ap-southeast-1, us-gov-west-1, cn-north-1, il-central-1, ...: a plan region
# named like an AWS region is taken as its bucket's region; other names (a lab's "dc-1") are not.
_AWS_REGION = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d{1,2}$")

_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
# Client errors no retry fixes, with what the user must change.
_PERMANENT = {
    "NoSuchBucket": "create the bucket or fix the bucket name in the plan",
    "InvalidBucketName": "fix the bucket name",
    "AccessDenied": "check the bucket policy and the credentials (docs/iam.md lists what each command needs)",
    "403": "access denied; check the credentials and the bucket policy (docs/iam.md)",
    "InvalidAccessKeyId": "check the credentials (access key id)",
    "SignatureDoesNotMatch": "check the credentials (secret key)",
    "ExpiredToken": "renew the session credentials",
    "InvalidToken": "renew the session credentials",
    "PermanentRedirect": "the bucket is in another region; name the plan region after the bucket's AWS region",
    "301": "the bucket is in another region; name the plan region after the bucket's AWS region",
    "AuthorizationHeaderMalformed": "the bucket is in another region; name the plan region after the bucket's AWS region",
    "InvalidRange": "the object is shorter than the manifest says; re-sync the region",
    "EntityTooLarge": "the object is over S3's single-PUT limit",
}


# Each S3 request's bound: connect and read (seconds of silence), two tries. An endpoint that
# accepts connections and never answers fails a call in 2 x this, not in minutes. GEOSHARD_TIMEOUT.
REQUEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Timeouts:
    """Bounds on every request of one client. ``attempts`` are botocore's own tries per call:
    1 where the caller owns retries (the tier chain, the checkpoint store), so they do not multiply."""

    connect_s: float = 5.0
    read_s: float = 60.0
    attempts: int = 3
    pool: int = 10


@dataclass(frozen=True)
class Failure:
    """What a boto3 error means: its kind, the S3 error code (or exception type), and a remedy
    for permanent ones. Built from codes and types only: SDK messages may quote request headers."""

    kind: Kind
    code: str
    remedy: str = ""
    answered: bool = True  # False: no answer from the endpoint (refused, timed out, lost)

    @property
    def bucket_missing(self) -> bool:
        return self.code == "NoSuchBucket"

    def describe(self) -> str:
        if not self.remedy:
            return self.code
        return f"{self.code}; {self.remedy}" if self.answered else self.remedy


def bucket_region(name: str | None) -> str | None:
    """``region_name`` for a bucket of plan region ``name``: the name when it is an AWS region."""
    return name if name and _AWS_REGION.match(name) else None


_data_loader: Any = None  # botocore's service models, parsed once per process and inherited by forks


def _botocore_session() -> Any:
    """A new botocore session (its own credentials and connection pools: nothing a forked loader
    worker shares with its parent) on the process's one data loader. A session of its own parses
    S3's service model and endpoint rules again: in a forked loader worker about 170 of the 235 ms
    its first batch took, once per worker and epoch (bench/startup_bench.py)."""
    import botocore.session

    global _data_loader
    session = botocore.session.get_session()
    # No lock (one held across a fork would stay held in the child): two threads racing here
    # only parse the models twice.
    if _data_loader is None:
        _data_loader = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _data_loader)
    return session


def client(endpoint: str | None, profile: str | None = None, region: str | None = None, timeouts: Timeouts = Timeouts()) -> Any:
    """A boto3 S3 client for a bucket of plan region ``region`` (see :func:`bucket_region`).

    Credentials come only from the AWS SDK chain (environment, ``profile``, instance role)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ProfileNotFound

    config = Config(
        connect_timeout=timeouts.connect_s,
        read_timeout=timeouts.read_s,
        retries={"total_max_attempts": timeouts.attempts, "mode": "standard"},  # the first try included
        max_pool_connections=timeouts.pool,
    )
    try:  # a missing profile shows when the session or its client is made, depending on boto3's version
        core = _botocore_session()
        session = boto3.session.Session(botocore_session=core, profile_name=profile)
        # Each boto3 session appends its data folder to the loader's search paths: on the shared
        # loader, once per client made, a list that grew for as long as the process ran.
        paths = core.get_component("data_loader").search_paths
        paths[:] = dict.fromkeys(paths)
        return session.client("s3", endpoint_url=endpoint, region_name=bucket_region(region), config=config)
    except ProfileNotFound as e:
        fix = f"; fix regions.{region}.profile in the plan" if region else ""
        raise ConfigError(f"AWS profile {profile!r} not found in the AWS config{fix}") from e


def classify(e: BaseException) -> Failure:
    """The one classification of an S3 (boto3/botocore) error, or of an OSError on its socket."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError, ProfileNotFound

    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "?")
        if code in _MISSING:
            return Failure("missing", code)
        if code in _PERMANENT:
            return Failure("permanent", code, _PERMANENT[code])
        return Failure("transient", code)  # 5xx, SlowDown, RequestTimeout, and codes we do not know
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return Failure("permanent", "NoCredentials", "no AWS credentials found; set the AWS_* variables or a profile in the plan", False)
    if isinstance(e, ProfileNotFound):
        return Failure("permanent", "ProfileNotFound", "the AWS profile named in the plan does not exist", False)
    return Failure("transient", type(e).__name__, answered=False)  # timeouts, refused or lost connections


def s3_client(endpoint: str | None, profile: str | None, region: str | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> Any:
    # A pool as wide as the parallel listings and checks sync issues on long links.
    return client(endpoint, profile, region, Timeouts(connect_s=min(timeout_s, 5.0), read_s=timeout_s, attempts=2, pool=32))
