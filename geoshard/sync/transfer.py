"""Bulk copies between local files and a region's bucket, through s5cmd.

Thin on purpose: it turns (local path, URL) pairs into s5cmd batches for the region's endpoint and
profile, and returns which URLs failed and why. Retries, verification and publication order are
the callers' business (push and pull).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from geoshard.sync.remote import BucketTarget
from geoshard.sync.s5cmd import Command, S5cmd, S5cmdSettings, download, upload

BATCH = 1000  # objects per s5cmd call: progress between calls, one process for the whole batch
ProgressFn = Callable[[dict[str, int]], None]


@dataclass(frozen=True)
class Transfer:
    local: str
    url: str
    size: int


class Transferer:
    def __init__(self, workers: int = 64, retry_count: int = 2, binary: str | None = None) -> None:
        self.workers = workers
        self.retry_count = retry_count
        self.binary = binary
        self._runners: dict[tuple[str | None, str | None], S5cmd] = {}

    def _runner(self, target: BucketTarget) -> S5cmd:
        key = (target.endpoint, target.profile)
        if key not in self._runners:
            settings = S5cmdSettings(
                endpoint_url=target.endpoint, profile=target.profile, numworkers=self.workers, retry_count=self.retry_count
            )
            self._runners[key] = S5cmd(settings, self.binary)
        return self._runners[key]

    def upload(self, transfers: Sequence[Transfer], target: BucketTarget, progress: ProgressFn | None = None) -> dict[str, str]:
        return self._run([upload(t.local, t.url) for t in transfers], transfers, target, progress, by_destination=True)

    def download(self, transfers: Sequence[Transfer], target: BucketTarget, progress: ProgressFn | None = None) -> dict[str, str]:
        return self._run([download(t.url, t.local) for t in transfers], transfers, target, progress, by_destination=False)

    def _run(
        self,
        commands: list[Command],
        transfers: Sequence[Transfer],
        target: BucketTarget,
        progress: ProgressFn | None,
        by_destination: bool,
    ) -> dict[str, str]:
        """Failed URLs mapped to s5cmd's error for each; endpoint-wide failures raise S5cmdError."""
        failures: dict[str, str] = {}
        runner = self._runner(target)
        size = {t.url: t.size for t in transfers}
        for i in range(0, len(commands), BATCH):
            result = runner.run_batch(commands[i : i + BATCH])
            done = 0
            nbytes = 0
            for r in result.results:
                url = r.destination if by_destination else r.source
                assert url is not None
                if r.success:
                    done += 1
                    nbytes += size.get(url, 0)
                else:
                    failures[url] = r.error or "failed"
            if progress is not None:
                progress({"objects": done, "bytes": nbytes})
        return failures
