"""Issue 20, part 5: a manifest is validated whole before anything is built from it. Hostile or
inconsistent values are one line (DataError, exit 1) naming the file and the field for ``verify``,
``inspect``, ``pull`` and the loader; ``verify`` counts each shard's samples against the manifest."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from guaranteekit import assert_one_line, geoshard, snapshot
from servers import SeaweedS3
from splitkit import make_corpus, write_plan
from synckit import sync_plan

from geoshard.errors import DataError
from geoshard.manifest import MANIFEST

EU = "eu-west-1"
Edit = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real split (several shards per region, each with chunk hashes), copied by each test."""
    tmp = tmp_path_factory.mktemp("trust-split")
    make_corpus(tmp / "corpus", samples=600, shard_samples=100)
    plan = write_plan(tmp / "plan.toml", shard_bytes="64KB")
    r = geoshard("split", tmp / "corpus", "--plan", plan, "--out", tmp / "out", "--workers", "1", cwd=tmp)
    assert r.rc == 0, r.err
    return tmp / "out"


def _copy(split: Path, tmp: Path) -> Path:
    out = tmp / "out"
    shutil.copytree(split, out)
    return out


def _edit(path: Path, edit: Edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _set(field: str, value: Any, shard: int = 0) -> Edit:
    return lambda d: d["shards"][shard].update({field: value})


def _shift_chunks(d: dict[str, Any]) -> None:
    chunks = d["shards"][0]["chunks"]["samples"]
    chunks[0] += 1  # the sum no longer matches the shard's
    d["shards"][0]["chunks"]["samples"] = chunks


def _repeat(d: dict[str, Any]) -> None:
    d["shards"].append(d["shards"][0])


CASES: dict[str, tuple[Edit | str, str]] = {
    "infinity": (_set("samples", float("inf")), "shards[0].samples must be an integer from 0 to"),
    "negative": (_set("samples", -5), "shards[0].samples must be an integer from 0 to 9,007,199,254,740,991, got -5"),
    "float": (_set("samples", 129.7), "shards[0].samples must be an integer from 0 to 9,007,199,254,740,991, got 129.7"),
    "too-many": (_set("samples", 10**10), "10,000,000,000 samples cannot fit in"),
    "bytes-inf": (_set("bytes", float("-inf")), "shards[0].bytes must be an integer"),
    "chunks-shifted": (_shift_chunks, "chunks: their bytes and samples must add up to the shard's"),
    "listed-twice": (_repeat, "is listed twice"),
    "nested": ('{"shards": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested deeper than"),
}


def _hostile(rdir: Path, case: str) -> None:
    edit, _ = CASES[case]
    if isinstance(edit, str):
        (rdir / MANIFEST).write_text(edit)
    else:
        _edit(rdir / MANIFEST, edit)


def _lower_counts(rdir: Path, less: int) -> dict[str, Any]:
    """Lower the first shard's count and its last chunks' counts alike; the shard as now listed."""
    d = json.loads((rdir / MANIFEST).read_text())
    s: dict[str, Any] = d["shards"][0]
    s["samples"] -= less
    for i in range(len(s["chunks"]["samples"]) - 1, -1, -1):
        take = min(less, s["chunks"]["samples"][i])
        s["chunks"]["samples"][i] -= take
        less -= take
    assert less == 0
    (rdir / MANIFEST).write_text(json.dumps(d))
    return s


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_and_inspect_refuse_a_hostile_manifest_in_one_line(split: Path, tmp_path: Path, case: str) -> None:
    out = _copy(split, tmp_path)
    _hostile(out / EU, case)
    before = snapshot(tmp_path)
    words = (f"{out / EU / MANIFEST}: ", CASES[case][1])
    assert_one_line(geoshard("verify", out, cwd=tmp_path, timeout=60), DataError.exit_code, *words)
    assert_one_line(geoshard("inspect", out / EU, cwd=tmp_path, timeout=60), DataError.exit_code, *words)
    assert snapshot(tmp_path) == before


def test_verify_counts_each_shards_samples(split: Path, tmp_path: Path) -> None:
    """A manifest consistent with itself (shard and chunk counts both lowered) but not with the
    shard's bytes: ``verify`` counts the samples and names the shard."""
    out = _copy(split, tmp_path)
    rdir = out / EU

    s = _lower_counts(rdir, 5)
    r = geoshard("verify", out, "--json", cwd=tmp_path, timeout=60)
    assert r.rc == 1, r.err
    report = json.loads(r.out)
    assert report["missing"] == [] and report["mismatched"] == [str(rdir / s["path"])]
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and f"holds {s['samples'] + 5} samples, its manifest says {s['samples']}" in lines[0], r.err


def test_pull_refuses_a_hostile_bucket_manifest_before_writing(tmp_path: Path, aws: SeaweedS3, split: Path) -> None:
    plan, buckets = sync_plan(tmp_path / "plan.toml", aws, "trustpull")
    aws.make_bucket(buckets[EU])
    rdir = _copy(split, tmp_path) / EU
    _hostile(rdir, "infinity")
    with contextlib.closing(aws.client()) as c:
        c.put_object(Bucket=buckets[EU], Key=f"train/{MANIFEST}", Body=(rdir / MANIFEST).read_bytes())
    to = tmp_path / "replica"
    before = snapshot(tmp_path)
    r = geoshard("pull", "--plan", plan, "--region", EU, "--to", to, cwd=tmp_path, timeout=60)
    assert_one_line(r, DataError.exit_code, f"s3://{buckets[EU]}/train/{MANIFEST}", "shards[0].samples must be an integer")
    assert snapshot(tmp_path) == before and not to.exists()


def test_the_loader_refuses_a_shard_holding_other_than_its_manifests_count(tmp_path: Path) -> None:
    """The shard's bytes match its hash, so every tier holds the same bytes: one DataError naming
    the shard, not 5 samples never served (nor an IndexError in a worker when the count is higher)."""
    from test_loaders import split as loader_split

    from geoshard.loaders import make_loader

    plan = loader_split(tmp_path, samples=600)
    s = _lower_counts(tmp_path / "split" / EU, 5)
    with pytest.raises(DataError, match=rf"{s['path']}: holds {s['samples'] + 5} samples where its manifest says {s['samples']}"):
        for _ in make_loader(plan, region=EU, num_workers=0, batch_size=1):
            pass


@pytest.mark.parametrize("case", ["infinity", "too-many"])
def test_train_refuses_a_hostile_manifest_before_it_starts(tmp_path: Path, case: str) -> None:
    from test_loaders import split as loader_split

    plan = loader_split(tmp_path, samples=600)
    rdir = tmp_path / "split" / EU
    _hostile(rdir, case)
    out = tmp_path / "run"
    args = ("--region", EU, "--out", out, "--nproc", "1", "--steps", 2, "--backend", "gloo")
    r = geoshard("train", "--plan", plan, *args, cwd=tmp_path, timeout=180)
    assert_one_line(r, DataError.exit_code, f"no tier has its {MANIFEST}: local:{EU}/{MANIFEST}: ", CASES[case][1])
    assert not list(out.glob("steps-*"))  # no step was trained
