"""Helpers for the generation tests (issue 19): a replicated two-region plan on SeaweedFS buckets,
sources added one tar at a time, and ``geoshard refresh`` publishing each new generation."""

from __future__ import annotations

import json
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from servers import SeaweedS3
from synckit import cli

from geoshard.formats import wds

US, EU = "us-east-1", "eu-west-1"


def gen_plan(tmp: Path, server: SeaweedS3, local: bool = True) -> Path:
    """Two regions that each hold every sample (equal counts: an epoch leaves nothing out), own buckets."""
    tag = f"gen{time.time_ns() % 10**9}"
    lines = ['[routing]\npolicy = "replicate"', '[shards]\nbytes = "24KB"']
    for r in (US, EU):
        lines.append(f'[regions.{r}]\nweight = 1\nbucket = "s3://{tag}-{r}/train"\nendpoint = "{server.endpoint}"')
        if local:
            lines[-1] += f'\nlocal = "{tmp / "replica" / r}"'
    plan = tmp / "plan.toml"
    plan.write_text("\n".join(lines) + "\n")
    return plan


def bucket_of(plan: Path, region: str) -> str:
    """The bucket name of ``region`` in a plan from ``gen_plan``."""
    url: str = tomllib.loads(plan.read_text())["regions"][region]["bucket"]
    return url.removeprefix("s3://").split("/")[0]


def add_source(folder: Path, prefix: str, n: int) -> set[str]:
    """A WebDataset tar of ``n`` samples keyed ``prefix00000``...; returns the keys."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = [f"{prefix}{i:05d}" for i in range(n)]
    with open(folder / f"{prefix}.tar", "wb") as f:
        w = wds.TarWriter(f)
        for k in keys:
            w.write_sample([(f"{k}.bin".encode(), k.encode() * 20), (f"{k}.cls".encode(), b"1")])
        w.close()
    return set(keys)


def refresh(sources: Path, plan: Path, out: Path, *extra: object) -> dict[str, Any]:
    r = cli("refresh", sources, "--plan", plan, "--out", out, "--create-buckets", "--json", *extra)
    assert r.exit_code == 0, r.output
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def keys_by_epoch(run: Path) -> dict[tuple[str, int], tuple[set[int], Counter[str]]]:
    """(region, epoch) -> (the generations its steps read, how often each key was read), over every rank."""
    gens: dict[tuple[str, int], set[int]] = defaultdict(set)
    counts: dict[tuple[str, int], Counter[str]] = defaultdict(Counter)
    for p in sorted(run.glob("keys-rank*.jsonl")):
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            at = (rec["region"], rec["epoch"])
            gens[at].add(rec["generation"])
            counts[at].update(rec["keys"])
    return {at: (gens[at], counts[at]) for at in gens}
