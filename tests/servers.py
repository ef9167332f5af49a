"""The test suite's servers: the local SeaweedFS S3 server lives in the package (the demo uses it too)."""

from geoshard.local.ports import closed_port, free_ports
from geoshard.local.seaweed import SeaweedS3, ServerError, seaweed_s3, weed_binary

__all__ = ["SeaweedS3", "ServerError", "closed_port", "free_ports", "seaweed_s3", "weed_binary"]
