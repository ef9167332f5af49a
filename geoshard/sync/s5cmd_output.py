"""Reading s5cmd's ``--json`` output: which command each line reports on, and which errors are fatal.

A run file executes in no fixed order, so results are matched to commands by their source and
destination, never by position.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

from geoshard.sync.s5cmd_commands import Command
from geoshard.sync.s5cmd_results import CommandResult, json_or_none

log = logging.getLogger(__name__)

Redact = Callable[[str], str]  # removes credentials from a line before it reaches a message or a log

# Errors that say the endpoint or the credentials are unusable, not that one object failed: no
# later command in the batch can succeed, so they raise instead of becoming per-object results.
# Anchored at the AWS error code that starts s5cmd's message, since the rest quotes object names.
_UNREACHABLE = re.compile(r"^(RequestError: send request failed|RequestCanceled)")
_BAD_CREDENTIALS = re.compile(
    r"^(session: .*)?(SignatureDoesNotMatch|InvalidAccessKeyId|NoCredentialProviders|ExpiredToken|InvalidToken"
    r"|InvalidClientTokenId|AuthorizationHeaderMalformed)\b"
)
_FORBIDDEN = re.compile(r"^(Forbidden|AccessDenied)\b")


def match_results(commands: Sequence[Command], out: bytes, err: bytes, redact: Redact) -> tuple[tuple[CommandResult, ...], list[str]]:
    """Pair s5cmd's JSON lines with commands; returns the results and errors no command claims."""
    # Success lines (stdout) name source and destination exactly, as JSON strings.
    pending: dict[tuple[str, str, str | None], deque[int]] = defaultdict(deque)
    for i, c in enumerate(commands):
        pending[(c.operation, c.source, c.destination)].append(i)
    done: dict[int, CommandResult] = {}
    for d in map(json_or_none, out.decode("utf-8", "replace").splitlines()):
        if not d or not d.get("success"):
            continue
        key = (str(d.get("operation")), str(d.get("source")), d.get("destination"))
        if pending.get(key):
            i = pending[key].popleft()
            size = (d.get("object") or {}).get("size")
            done[i] = CommandResult(commands[i], success=True, size=int(size) if size is not None else None)
        else:
            log.warning("s5cmd reported a result for no command in the batch: %s", redact(f"{key[1]} {key[2] or ''}"))
    # Error lines (stderr) only carry "command": operation, flags and args joined by spaces,
    # which is ambiguous when names hold spaces. Only commands without a success line can have
    # failed, and their args must end that string, so at worst two failures swap messages.
    errors: dict[int, str] = {}
    stray: list[str] = []
    open_ = [i for i in range(len(commands)) if i not in done]
    for d in map(json_or_none, err.decode("utf-8", "replace").splitlines()):
        if not d or "error" not in d:
            continue
        message = redact(str(d["error"]))
        said = str(d.get("command", ""))
        matches = [
            i
            for i in open_
            if d.get("operation") == commands[i].operation
            and said.startswith(commands[i].operation + " ")
            and said.endswith(" " + " ".join(commands[i].args))
        ]
        fresh = [i for i in matches if i not in errors]
        if fresh:
            errors[fresh[0]] = message
        elif matches:  # a second message for the same command
            errors[matches[0]] += "; " + message
        else:
            stray.append(message)
    for i in open_:
        done[i] = CommandResult(commands[i], success=False, error=errors.get(i, "s5cmd reported no result for this command"))
    return tuple(done[i] for i in range(len(commands))), stray


def is_fatal(error: str) -> bool:
    """The endpoint or the credentials are unusable: no later command of the batch can succeed."""
    return bool(_UNREACHABLE.search(error) or _BAD_CREDENTIALS.search(error))


def remedy(reason: str, where: str) -> str:
    """What to do about a run that failed as a whole with ``reason`` at endpoint ``where``."""
    if _UNREACHABLE.search(reason):
        return f"cannot reach {where}; check the endpoint URL and that the service is up"
    if _BAD_CREDENTIALS.search(reason):
        return f"{where} rejected the credentials; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile for it"
    if _FORBIDDEN.search(reason):  # HEAD replies (cat, ls of one key) carry no error code to tell these apart
        return f"{where} refused access (403); check the credentials and their permissions on the bucket"
    return "see s5cmd's messages below"
