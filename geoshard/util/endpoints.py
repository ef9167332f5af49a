"""S3 endpoints as safe to print: shared by sync, the loaders' S3 tier and the trainer's checkpoints."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def display_endpoint(endpoint: str | None) -> str:
    """The endpoint without user:password, query or fragment (messages, logs and reports)."""
    if not endpoint:
        return "the default AWS endpoint"
    u = urlsplit(endpoint)
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{u.port}" if u.port else host
    return urlunsplit((u.scheme, netloc, u.path, "", ""))
