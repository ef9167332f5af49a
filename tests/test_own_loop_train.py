"""Issue 22, item 2: ``geoshard train``'s built-in model on your own corpus (``--input-field``,
``--label-field``): a WebDataset made with webdataset's ``ShardWriter`` (``jpg``, ``cls``,
``json``), a TFRecord corpus by feature names, and ``--model none`` under DiLoCo (no model: no
outer rounds, nothing moved). Each runs the real command and checks its whole output."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from splitkit import make_corpus
from test_own_loop import geoshard, make_own_corpus

TRAIN = ("--batch-size", "16", "--num-workers", "1", "--backend", "gloo")


@pytest.fixture(scope="module")
def shardwriter_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_own_corpus(tmp_path_factory.mktemp("ownwds"))


@pytest.fixture(scope="module")
def tfrecord_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("owntf")
    make_corpus(tmp / "corpus", fmt="tfrecord", samples=600, sample_bytes=300, shard_samples=200)
    plan = tmp / "plan.toml"
    plan.write_text(f'[shards]\nbytes = "256KB"\n[regions.eu-west-1]\nweight = 1\nlocal = "{tmp / "split" / "eu-west-1"}"\n')
    r = geoshard("split", tmp / "corpus", "--plan", plan, "--out", tmp / "split", "--workers", "1")
    assert r.returncode == 0, r.stderr
    return plan


def one_line(r: subprocess.CompletedProcess[str], words: str) -> None:
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"geoshard: error: {words}"], r.stderr


def summary_lines(stdout: str) -> list[str]:
    """The run's lines before the report's tables (the progress bar's last state apart, and the
    "  try: ..." advice under a verdict, which follows the run's measured times: test_verdicts.py)."""
    lines = [x for x in stdout.splitlines() if not re.match(r"step \d+/\d+ |  try: ", x)]
    return lines[: next(i for i, x in enumerate(lines) if x.startswith("step time"))]


HINT = (
    "name yours with --input-field FIELD --label-field FIELD, measure your own data with --model none --step-time 80ms, "
    "or train your model on geoshard.loaders (docs/cli.md)"
)


@pytest.mark.slow
def test_train_reads_the_named_fields_of_a_shardwriter_corpus(shardwriter_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    base = ("train", "--plan", shardwriter_plan, "--region", "eu-west-1", "--steps", "20", "--out", out)
    one_line(geoshard(*base), f"region eu-west-1: its samples have cls, jpg, json; the built-in model needs img and cls; {HINT}")
    one_line(
        geoshard(*base, "--input-field", "jpg", "--label-field", "json"),
        "region eu-west-1: sample 'img_000002': label field 'json' is not an integer "
        """(b'{"origin": "ap-southeast-1", "i": 2}'); --label-field names one""",
    )
    assert not out.exists()  # nothing launched

    r = geoshard(*base, "--nproc", "2", *TRAIN, "--input-field", "jpg", "--input-field", "json", "--label-field", "cls")
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    lines = summary_lines(r.stdout)
    assert lines[:2] == [
        "geoshard.trainer: 2 rank(s): eu-west-1: 2 rank(s); gradient sync flat",
        "geoshard.trainer: 490 samples per rank and epoch; per epoch eu-west-1 980 of 980 (0 left out)",
    ], r.stdout
    assert re.fullmatch(r"IO wait: [\d.]+% of training time, budget 5\.0%: (within|over) budget", lines[2]), lines
    assert re.fullmatch(r"2 rank\(s\) in eu-west-1, 20 steps \(1\.\.20\), 640 samples, loss [\d.]+ → [\d.]+", lines[3]), lines
    report = json.loads((out / "report.json").read_text())
    assert (report["steps"], report["samples"]) == (20, 640) and report["loss_first"] > 0


@pytest.mark.slow
def test_train_reads_tfrecord_features_by_name(tfrecord_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    base = ("train", "--plan", tfrecord_plan, "--region", "eu-west-1", "--steps", "10", "--out", out)
    one_line(
        geoshard(*base),
        "region eu-west-1: its shards are tfrecord; the built-in model reads WebDataset samples with img and cls fields, "
        f"or the features --input-field and --label-field name (its records have image, key, label, origin); {HINT}",
    )
    one_line(
        geoshard(*base, "--input-field", "img", "--label-field", "label"),
        f"region eu-west-1: its records have features image, key, label, origin; the built-in model needs img and label; {HINT}",
    )
    r = geoshard(*base, "--nproc", "1", *TRAIN, "--input-field", "image", "--label-field", "label")
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    lines = summary_lines(r.stdout)
    assert lines[0] == "geoshard.trainer: 1 rank(s): eu-west-1: 1 rank(s); gradient sync flat", r.stdout
    assert re.fullmatch(r"1 rank\(s\) in eu-west-1, 10 steps \(1\.\.10\), 160 samples, loss [\d.]+ → [\d.]+", lines[3]), lines


@pytest.mark.slow
def test_model_none_under_diloco_moves_no_pseudo_gradients(shardwriter_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    regions = ("--regions", "us-east-1:1,eu-west-1:1", "--sync", "diloco", "--outer-steps", "5")
    data_only = ("--model", "none", "--step-time", "10ms")
    r = geoshard("train", "--plan", shardwriter_plan, *regions, *data_only, "--steps", "10", *TRAIN, "--out", out)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    for region in ("us-east-1", "eu-west-1"):
        line = f"geoshard.trainer: {region}: 1 of the job's 2 rank(s); --model none: no model, so no outer rounds between the regions"
        assert line + " (no pseudo-gradients to average)" in r.stdout.splitlines(), r.stdout
    assert "2 rank(s) in eu-west-1, us-east-1, 10 steps (1..10), 320 samples" in r.stdout, r.stdout
    assert "across regions: data 0 B (goal 0), gradients none; " in r.stdout, r.stdout
    assert not list(out.glob("rounds-*.jsonl"))  # nothing went through the outer store
    report = json.loads((out / "report.json").read_text())
    assert report["outer"] is None and report["loss_first"] is None
