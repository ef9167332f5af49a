"""The lines of an s5cmd run file: one-object copies and deletes, checked and quoted.

s5cmd reads a run file line by line and splits each line with POSIX shell word rules (without
expansion); the builders here make lines that name exactly one object each, whatever its name.
"""

from __future__ import annotations

import os
import shlex
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from geoshard.errors import ConfigError


@dataclass(frozen=True)
class Command:
    """One line of a run file: ``operation [flags] args``; build it with upload/download/remove.

    run_batch matches results for one-object ``cp`` and ``rm`` lines (what the builders make).
    """

    operation: str
    args: tuple[str, ...]
    flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.args:
            raise ConfigError(f"s5cmd {self.operation}: a command needs at least one argument")
        for part in (self.operation, *self.flags, *self.args):
            _check_word(part)

    @property
    def source(self) -> str:
        return self.args[0]

    @property
    def destination(self) -> str | None:
        return self.args[1] if len(self.args) > 1 else None

    def line(self) -> str:
        """The run-file line. s5cmd splits it with go-shellquote (POSIX sh word rules, no expansion).

        shlex.quote's single quoting ('...' with each ' written as '"'"') is read back verbatim by
        that parser; nothing inside single quotes is special, so $(x), ;, `, \\ and " stay literal.
        """
        return " ".join(shlex.quote(w) for w in (self.operation, *self.flags, *self.args))


def _check_word(word: str) -> None:
    # s5cmd reads the run file line by line (a newline cannot be quoted) and Go strings from the
    # file are UTF-8; file names that are not valid UTF-8 could not be named at all.
    if "\n" in word or "\0" in word:
        raise ConfigError(f"{word!r}: names with a newline or NUL cannot be passed to s5cmd")
    try:
        word.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{word!r}: the name is not valid UTF-8 and cannot be passed to s5cmd") from e


def _check_object_url(url: str) -> None:
    bucket, _, key = url[5:].partition("/") if url.startswith("s3://") else ("", "", "")
    if not bucket or not key or key.endswith("/"):
        # A trailing slash makes s5cmd treat the URL as a prefix and append the source's name.
        raise ConfigError(f"{url}: expected an object URL, s3://bucket/key (not a bucket or a prefix)")


def upload(local_path: str | os.PathLike[str], url: str, *, content_type: str | None = None) -> Command:
    """``cp`` of one local file to one object. ``--raw``: *, ? and [ in names are literal, not globs."""
    _check_object_url(url)
    flags = ("--raw",) if content_type is None else ("--raw", f"--content-type={content_type}")
    # Absolute, so a name starting with '-' is never read as a flag and the cwd does not matter.
    return Command("cp", (os.path.abspath(local_path), url), flags)


def download(url: str, local_path: str | os.PathLike[str]) -> Command:
    """``cp`` of one object to one local file (folders above it are created)."""
    _check_object_url(url)
    path = os.path.abspath(local_path)
    if str(local_path).endswith(os.sep):
        raise ConfigError(f"{local_path}: give the file to write, not a folder")
    return Command("cp", (url, path), ("--raw",))


def remove(url: str) -> Command:
    """``rm`` of one object; removing a missing key succeeds (S3 semantics)."""
    _check_object_url(url)
    return Command("rm", (url,), ("--raw",))


def describe(c: Command) -> str:
    return f"{c.operation} {c.source}" + (f" -> {c.destination}" if c.destination else "")


def summary(commands: Sequence[Command]) -> str:
    counts = Counter(c.operation for c in commands)
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))
    return f"run ({len(commands)} commands: {ops})"
