"""Issue 20, part 4: checkpoints are never silently dropped. ``geoshard train --resume`` with
``latest.json`` missing or broken while checkpoint files are present resumes from the newest file
that loads (saying so in one line) or refuses in one line; it never starts from scratch over them,
nor prunes or overwrites them. (DiLoCo's per-region checkpoints are another part of the issue.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from guaranteekit import Run, assert_one_line, geoshard
from test_loaders import EU, split

from geoshard.errors import StorageError

CKPT_15, CKPT_20, CKPT_25 = "ckpt-000000015.pt", "ckpt-000000020.pt", "ckpt-000000025.pt"


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split(tmp_path_factory.mktemp("corpus"), samples=1500)


def _train(plan: Path, out: Path, steps: int, *extra: object) -> Run:
    args = ("train", "--plan", plan, "--region", EU, "--out", out, "--nproc", "1", "--steps", steps, "--backend", "gloo")
    return geoshard(*args, "--batch-size", 16, "--checkpoint-every", 5, "--checkpoint-keep", 2, *extra, cwd=out.parent, timeout=300)


@pytest.fixture(scope="module")
def run20(plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 steps with checkpoints every 5, the last two kept: ckpt-15 and ckpt-20."""
    out = tmp_path_factory.mktemp("run20") / "run"
    r = _train(plan, out, 20)
    assert r.rc == 0, r.err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*")) == [CKPT_15, CKPT_20]
    return out


def _copy_run(run20: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run20, out)
    return out


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "steps-rank0.jsonl").read_text().splitlines()]


def _warnings(r: Run, words: str) -> list[str]:
    return [line for line in r.err.splitlines() if words in line]


@pytest.mark.parametrize("pointer", ["removed", "nested"])
def test_resume_without_a_usable_pointer_continues_from_the_newest_checkpoint(
    plan: Path, run20: Path, tmp_path: Path, pointer: str
) -> None:
    out = _copy_run(run20, tmp_path)
    ckpt = out / "checkpoints"
    if pointer == "removed":
        (ckpt / "latest.json").unlink()
        why = "no latest.json"
    else:
        (ckpt / "latest.json").write_text("[" * 200_000 + "]" * 200_000)
        why = "latest.json is malformed (nested too deeply)"
    newest = (ckpt / CKPT_20).read_bytes()
    r = _train(plan, out, 25, "--resume")
    assert r.rc == 0, r.err[-3000:]
    said = _warnings(r, "resuming from")
    assert len(said) == 1 and f"{why}; resuming from {CKPT_20}, the newest of 2 checkpoint files that loads" in said[0], r.err
    assert "Traceback" not in r.err and "starting from scratch" not in r.err
    assert _steps(out) == list(range(1, 26))  # steps 1..20 kept from the first run, 21..25 trained now
    # ckpt-20 was not overwritten and the new pointer keeps it as the previous checkpoint.
    assert (ckpt / CKPT_20).read_bytes() == newest
    p = json.loads((ckpt / "latest.json").read_text())
    assert (p["step"], [e["path"] for e in p["previous"]]) == (25, [CKPT_20])


def test_resume_refuses_when_no_checkpoint_file_loads_and_deletes_none(plan: Path, run20: Path, tmp_path: Path) -> None:
    out = _copy_run(run20, tmp_path)
    ckpt = out / "checkpoints"
    (ckpt / "latest.json").unlink()
    for name in (CKPT_15, CKPT_20):
        (ckpt / name).write_bytes((ckpt / name).read_bytes()[:1000])  # truncated, as by a full disk
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    steps_before = (out / "steps-rank0.jsonl").read_bytes()
    r = _train(plan, out, 25, "--resume")
    assert_one_line(
        r,
        StorageError.exit_code,
        f"rank 0: {ckpt}: no latest.json, and none of its 2 checkpoint files loads ({CKPT_20} does not load",
        "refusing to start from scratch over them",
    )
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # nothing pruned, nothing written
    assert (out / "steps-rank0.jsonl").read_bytes() == steps_before
