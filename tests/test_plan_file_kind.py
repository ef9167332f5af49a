"""A WAN matrix or a split's JSON manifest passed as ``--plan``: one line saying what the file is,
through the real ``geoshard split`` command (issue 22, item 12)."""

from __future__ import annotations

from pathlib import Path

from guaranteekit import assert_one_line, geoshard
from splitkit import make_corpus, write_plan

from geoshard.local.demo import DEMO_WAN


def test_wan_matrix_as_plan_says_it_is_a_matrix(tmp_path: Path) -> None:
    make_corpus(tmp_path / "src", samples=20)
    (tmp_path / "wan.toml").write_text(DEMO_WAN)
    r = geoshard("split", tmp_path / "src", "--plan", tmp_path / "wan.toml", "--out", tmp_path / "out", cwd=tmp_path)
    line = assert_one_line(r, 2)
    assert line == f"geoshard: error: {tmp_path / 'wan.toml'}: looks like a WAN matrix ([[link]] tables), not a plan; pass it with --wan"
    assert not (tmp_path / "out").exists()


def test_manifests_as_plan_say_they_are_manifests(tmp_path: Path) -> None:
    make_corpus(tmp_path / "src", samples=50)
    plan = write_plan(tmp_path / "plan.toml")
    assert geoshard("split", tmp_path / "src", "--plan", plan, "--out", tmp_path / "split", "--json", cwd=tmp_path).rc == 0
    for manifest in (tmp_path / "split" / "manifest.json", tmp_path / "split" / "us-east-1" / "manifest.json"):
        r = geoshard("split", tmp_path / "src", "--plan", manifest, "--out", tmp_path / "out", cwd=tmp_path)
        line = assert_one_line(r, 2)
        assert line == (
            f"geoshard: error: {manifest}: is a JSON manifest written by geoshard split, not a TOML plan; "
            "pass the plan the split was made with"
        )
    assert not (tmp_path / "out").exists()


def test_other_json_as_plan_says_json(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text('{"regions": {"a": {"weight": 1}}}\n')
    r = geoshard("split", tmp_path, "--plan", tmp_path / "plan.json", "--out", tmp_path / "out", cwd=tmp_path)
    assert assert_one_line(r, 2) == f"geoshard: error: {tmp_path / 'plan.json'}: is JSON, not a TOML plan"
