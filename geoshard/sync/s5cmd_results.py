"""What an s5cmd run gives back: each object's outcome, the batch's, or an error for the whole run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geoshard.errors import StorageError
from geoshard.sync.s5cmd_commands import Command, describe
from geoshard.util.endpoints import display_endpoint


class S5cmdError(StorageError):
    """s5cmd failed as a whole (or could not run). ``returncode`` is s5cmd's exit status.

    ``exit_code`` stays the CLI's code for a storage error; s5cmd's own status is ``returncode``
    (None when it never ran or was killed). ``command`` is the argv, which never holds credentials.
    ``result`` holds the per-object outcomes when s5cmd got as far as reporting them.
    """

    def __init__(
        self,
        message: str,
        *,
        command: Sequence[str] = (),
        returncode: int | None = None,
        stderr_tail: str = "",
        result: BatchResult | None = None,
    ) -> None:
        super().__init__(message)
        self.command = tuple(command)
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        self.result = result


class S5cmdNotFoundError(S5cmdError):
    """The s5cmd binary is not installed where expected."""


class S5cmdTimeoutError(S5cmdError):
    """s5cmd ran past ``timeout_s`` and was killed."""


@dataclass(frozen=True)
class CommandResult:
    command: Command
    success: bool
    error: str | None = None  # s5cmd's message, credentials removed
    size: int | None = None  # bytes copied; None for rm

    @property
    def operation(self) -> str:
        return self.command.operation

    @property
    def source(self) -> str:
        return self.command.source

    @property
    def destination(self) -> str | None:
        return self.command.destination


@dataclass(frozen=True)
class BatchResult:
    results: tuple[CommandResult, ...]  # in the order the commands were given
    returncode: int
    elapsed_s: float
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return all(r.success for r in self.results)

    @property
    def succeeded(self) -> tuple[CommandResult, ...]:
        return tuple(r for r in self.results if r.success)

    @property
    def failed(self) -> tuple[CommandResult, ...]:
        return tuple(r for r in self.results if not r.success)

    def raise_for_failures(self, endpoint: str | None = None) -> None:
        """Raise S5cmdError naming the first failures, if any command failed."""
        failed = self.failed
        if not failed:
            return
        shown = "; ".join(f"{describe(r.command)}: {r.error}" for r in failed[:5])
        more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
        raise S5cmdError(
            f"s5cmd: {len(failed)} of {len(self.results)} transfers failed at {display_endpoint(endpoint)}: {shown}{more}",
            returncode=self.returncode,
            stderr_tail=self.stderr_tail,
            result=self,
        )


@dataclass(frozen=True)
class RunOutput:
    stdout: bytes
    stderr: str
    returncode: int
    elapsed_s: float

    def json_lines(self) -> list[dict[str, Any]]:
        """stdout's JSON lines (``ls``, ``du``...); other lines are skipped."""
        return [d for d in map(json_or_none, self.stdout.decode("utf-8", "replace").splitlines()) if d is not None]


def json_or_none(line: str) -> dict[str, Any] | None:
    # s5cmd and the AWS SDK also print plain-text lines (usage text, SDK warnings).
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None
