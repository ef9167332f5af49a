"""One exception base; each class owns the exit code the CLI returns for it (click's model)."""

from __future__ import annotations


class GeoshardError(Exception):
    """Base of every error geoshard raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(GeoshardError):
    """Invalid plan, option or output folder: the user must change what they passed."""

    exit_code = 2


class DataError(GeoshardError):
    """A source or shard is missing, malformed or does not match its manifest."""

    exit_code = 1


class StorageError(GeoshardError):
    """A storage endpoint or tier failed (S3, local replica, cache)."""

    exit_code = 1


class SyncError(GeoshardError):
    """A region could not be published; its previous manifest stays in place."""

    exit_code = 1


class LockedError(GeoshardError):
    """Another run holds the lock; EX_TEMPFAIL so cron wrappers can tell it apart."""

    exit_code = 75
