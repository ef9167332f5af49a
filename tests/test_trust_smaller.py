"""Issue 20, part 6: a FIFO or a device link as a SOURCE says what it is, ``--out`` inside a
source folder is refused up front, and ``geoshard wan check`` refuses a latency it cannot measure.
Each is one line and leaves the tree as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from guaranteekit import assert_one_line, geoshard, snapshot
from splitkit import make_corpus, write_plan

from geoshard.errors import ConfigError


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("fifo", "a FIFO (named pipe); a SOURCE is a regular file, a folder or a glob"),
        ("dev-zero", "a symbolic link to /dev/zero, a character device"),
        ("loop", "which loops back on itself"),
    ],
)
def test_a_source_that_is_no_file_says_what_it_is(tmp_path: Path, kind: str, words: str) -> None:
    source = tmp_path / "in.tar"
    if kind == "fifo":
        os.mkfifo(source)
    elif kind == "dev-zero":
        source.symlink_to("/dev/zero")
    else:
        source.symlink_to(source)
    plan = write_plan(tmp_path / "plan.toml")
    before = snapshot(tmp_path)
    r = geoshard("split", source, "--plan", plan, "--out", tmp_path / "out", "--workers", "1", cwd=tmp_path, timeout=60)
    line = assert_one_line(r, ConfigError.exit_code, f"{source}: ", words)
    assert "not found" not in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("inside", [".", "out", "sub/out"])
def test_out_inside_the_source_folder_is_refused_up_front(tmp_path: Path, inside: str) -> None:
    corpus = tmp_path / "corpus"
    make_corpus(corpus, samples=100)
    plan = write_plan(tmp_path / "plan.toml")
    out = corpus / inside
    before = snapshot(tmp_path)
    for source in (corpus, f"{corpus}/**/*.tar"):
        r = geoshard("split", source, "--plan", plan, "--out", out, "--workers", "1", cwd=tmp_path, timeout=60)
        assert_one_line(r, ConfigError.exit_code, f"--out {out}: inside the source folder {source}", "choose a folder outside it")
    assert snapshot(tmp_path) == before


def test_out_beside_the_source_folder_still_splits(tmp_path: Path) -> None:
    make_corpus(tmp_path / "corpus", samples=100)
    plan = write_plan(tmp_path / "plan.toml")
    r = geoshard("split", tmp_path / "corpus", "--plan", plan, "--out", tmp_path / "corpus-out", "--workers", "1", cwd=tmp_path)
    assert r.rc == 0, r.err


def test_wan_check_refuses_a_latency_it_cannot_measure(tmp_path: Path) -> None:
    path = tmp_path / "wan.toml"
    path.write_text('[[link]]\na = "us-east-1"\nb = "eu-west-1"\nlatency_ms = 10000\n')
    before = snapshot(tmp_path)
    r = geoshard("wan", "check", path, cwd=tmp_path, timeout=60)
    assert_one_line(
        r, ConfigError.exit_code, f"{path}: link us-east-1 <-> eu-west-1: latency_ms 10000 is more than wan check can measure (at most 3000"
    )
    assert r.seconds < 30 and snapshot(tmp_path) == before
