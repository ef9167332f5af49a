"""Before launch: is each region the job reads published where its loader looks?

A region that was never synced would otherwise cost torchrun's start and end in a rank's
``NoSuchBucket`` or ``NoSuchKey``. The check asks the region's tier chain (Alluxio, local replica,
bucket, and other regions' buckets where the plan's [egress] allows) for its manifest, as the
loader will, within the chain's bounded timeouts; only
when none has it and the bucket answers that the manifest or the bucket does not exist is the
region refused. Any other failure (an endpoint down) is left to the ranks to report as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from geoshard import s3
from geoshard.errors import ConfigError
from geoshard.manifest import MANIFEST
from geoshard.plan import Plan, Region

log = logging.getLogger(__name__)


def check_published(plan: Plan, regions: Sequence[str], plan_label: str) -> None:
    """ConfigError (exit 2), one line naming the unpublished regions and the sync that publishes them."""
    missing = [plan.region(n) for n in regions if not _readable(plan, n)]
    if not missing:
        return
    others = ", nor another region's bucket" if plan.egress.cross_region else ""
    where = ", ".join(_manifest_url(r) for r in missing)
    names = ", ".join(r.name for r in missing)
    flags = " ".join(f"--region {r.name}" for r in missing)
    what = f"region {names} is" if len(missing) == 1 else f"regions {names} are"
    raise ConfigError(
        f"{what} not published: no {where}, and no local replica or Alluxio copy{others}; "
        f"publish with: geoshard sync SPLIT_DIR --plan {plan_label} {flags}"
    )


def _readable(plan: Plan, name: str) -> bool:
    from geoshard.loaders.chain import AllTiersFailed, build_chain

    try:
        build_chain(plan, name).read_manifest()  # the loader's own chain: cross-region as the plan says
        return True
    except AllTiersFailed as e:
        log.debug("region %s: %s", name, e)
    region = plan.region(name)
    return region.bucket is None or not _bucket_lacks_manifest(region)


def _bucket_lacks_manifest(region: Region) -> bool:
    """Whether the bucket answers that its manifest, or the bucket itself, does not exist."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = s3.client(region.endpoint, region.profile, region.name, s3.Timeouts(connect_s=5.0, read_s=10.0, attempts=1, pool=1))
    try:
        client.head_object(Bucket=region.bucket_name, Key=_manifest_key(region))
    except ClientError as e:
        failure = s3.classify(e)
        return failure.kind == "missing" or failure.code == "NoSuchBucket"
    except BotoCoreError:
        return False
    return False


def _manifest_key(region: Region) -> str:
    return f"{region.bucket_prefix}/{MANIFEST}" if region.bucket_prefix else MANIFEST


def _manifest_url(region: Region) -> str:
    return f"s3://{region.bucket_name}/{_manifest_key(region)}"
