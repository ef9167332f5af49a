"""Helpers for the sync tests: a split whose plan points every region at a SeaweedFS bucket."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result
from servers import SeaweedS3
from splitkit import REGIONS, make_corpus

from geoshard.cli import main

_ids = itertools.count()


def sync_plan(
    path: Path, server: SeaweedS3, tag: str, weights: tuple[int, ...] = (2, 1, 1), shard_bytes: str = "64KB"
) -> tuple[Path, dict[str, str]]:
    """A plan whose regions each have their own bucket on ``server``; returns it and the bucket names."""
    n = next(_ids)
    buckets = {r: f"gs-{tag}-{n}-{r.replace('-', '')}"[:63] for r in REGIONS}
    lines = [f'[shards]\nbytes = "{shard_bytes}"']
    for r, w in zip(REGIONS, weights, strict=True):
        lines.append(f'[regions.{r}]\nweight = {w}\nbucket = "s3://{buckets[r]}/train"\nendpoint = "{server.endpoint}"')
    path.write_text("\n".join(lines) + "\n")
    return path, buckets


def make_split(tmp: Path, plan: Path, samples: int = 600, shard_samples: int = 100, seed: int = 0) -> Path:
    make_corpus(tmp / "corpus", samples=samples, shard_samples=shard_samples, seed=seed)
    out = tmp / "split"
    r = cli("split", tmp / "corpus", "--plan", plan, "--out", out, "--workers", "1")
    assert r.exit_code == 0, r.output
    return out


def cli(*args: object, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)


def objects(server: SeaweedS3, bucket: str) -> dict[str, bytes]:
    """Every object of ``bucket`` (key -> bytes)."""
    out = {}
    with contextlib.closing(server.client()) as c:
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                body = c.get_object(Bucket=bucket, Key=o["Key"])["Body"]
                with body:
                    out[o["Key"]] = body.read()
    return out


def remote_manifest(server: SeaweedS3, bucket: str) -> dict[str, Any] | None:
    data = objects(server, bucket).get("train/manifest.json")
    return None if data is None else json.loads(data)
