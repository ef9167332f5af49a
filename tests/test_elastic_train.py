"""Issue 19, part 4, end to end: ``geoshard train --resume`` (real torchrun, gloo, local replicas,
keys logged with ``--log-keys``) on another number of ranks in a region (3 -> 2, 2 -> 4) and with
a region added: in the interrupted epoch every key of a region once across the two segments (less
a remainder under the new rank count), and the next epoch the new world's own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_loaders import EU, region_samples, split

from geoshard.loaders.balance import balance

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
US, AP = "us-east-1", "ap-southeast-1"
BATCH = 16
FLAGS = ("--batch-size", BATCH, "--num-workers", 1, "--backend", "gloo", "--log-keys", "--model", "none", "--no-allow-cross-region")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,200 samples over three regions with local replicas: eu-west-1 holds about 310."""
    return split(tmp_path_factory.mktemp("corpus"), samples=1200)


def train(plan: Path, out: Path, where: tuple[object, ...], steps: int, *args: object) -> str:
    """``geoshard train`` to the end (a checkpoint at its last step); its output."""
    argv = [GEOSHARD, "train", "--plan", str(plan), *map(str, where), "--out", str(out), "--steps", str(steps)]
    argv += ["--checkpoint-every", str(steps), *map(str, FLAGS), *map(str, args)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=out.parent, check=False)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-5000:]
    return text


def logged(out: Path) -> list[dict[str, Any]]:
    """Every rank's key records: {"step", "region", "keys"}."""
    return [json.loads(line) for p in sorted(out.glob("keys-rank*.jsonl")) for line in p.read_text().splitlines()]


def region_keys(plan: Path, region: str) -> set[str]:
    return {s["__key__"] for s in region_samples(plan.parent / "split" / region, "wds")}


Records = list[dict[str, Any]]


def resume_on(
    plan: Path, tmp: Path, before: tuple[object, ...], after: tuple[object, ...], cut: int, extra: int
) -> tuple[Records, Records, str]:
    """``cut`` steps on ``before``, then ``--resume`` on ``after`` for ``extra`` more: each
    segment's key records, and the second's output."""
    out = tmp / "run"
    out.mkdir()
    train(plan, out, before, cut)
    first = logged(out)
    assert {r["step"] for r in first} == set(range(1, cut + 1))
    text = train(plan, out, after, cut + extra, "--resume")
    second = [r for r in logged(out) if r["step"] > cut]
    return first, second, text


def epoch_split(records: Records, cut: int, per: int) -> tuple[Counter[str], Counter[str]]:
    """The second segment's keys in the interrupted epoch (each rank's first ``per`` samples after
    ``cut``, in whole batches and a short last one) and after it."""
    in_epoch: Counter[str] = Counter()
    later: Counter[str] = Counter()
    batches = -(-per // BATCH)
    for r in records:
        (in_epoch if r["step"] <= cut + batches else later).update(r["keys"])
    return in_epoch, later


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 4)])
def test_resume_on_another_rank_count_reads_every_key_of_the_epoch_once(plan: Path, tmp_path: Path, old: int, new: int) -> None:
    keys = region_keys(plan, EU)
    per_old = len(keys) // old
    cut = per_old // BATCH // 2  # mid-epoch, in whole batches
    rest = (per_old - cut * BATCH) * old
    per_new = rest // new
    batches = -(-per_new // BATCH)
    first, second, text = resume_on(plan, tmp_path, ("--region", EU, "--nproc", old), ("--region", EU, "--nproc", new), cut, batches + 3)
    line = f"epoch 0 resumes on {new} rank(s) of the region (saved on {old}): {rest} samples left, {per_new} per rank"
    assert line in text, text[-3000:]
    seen: Counter[str] = Counter(k for r in first for k in r["keys"])
    in_epoch, later = epoch_split(second, cut, per_new)
    seen += in_epoch
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:5]
    assert set(seen) <= keys and 0 <= per_old * old - seen.total() < new, (per_old * old, seen.total())
    assert max(later.values()) == 1 and set(later) <= keys and later.total() == 3 * BATCH * new  # the next epoch's own


@pytest.mark.slow
def test_resume_with_a_region_added_reads_every_key_of_the_epoch_once(plan: Path, tmp_path: Path) -> None:
    counts = {r: len(region_keys(plan, r)) for r in (US, EU, AP)}
    per_old = balance(counts, {US: 1, EU: 1}).samples_per_rank
    per_added = balance(counts, {US: 1, EU: 1, AP: 1}).samples_per_rank
    cut = per_old // BATCH // 2
    per_rest = per_old - cut * BATCH  # one rank per region: the rest of each one's epoch
    extra = -(-per_rest // BATCH) + 2
    first, second, text = resume_on(plan, tmp_path, ("--regions", f"{US}:1,{EU}:1"), ("--regions", f"{US}:1,{EU}:1,{AP}:1"), cut, extra)
    assert "ap-southeast-1: no saved position for this region: it begins epoch 0" in text, text[-3000:]
    for region in (US, EU):
        seen: Counter[str] = Counter(k for r in first if r["region"] == region for k in r["keys"])
        in_epoch, later = epoch_split([r for r in second if r["region"] == region], cut, per_rest)
        seen += in_epoch
        assert max(seen.values()) == 1 and seen.total() == per_old and set(seen) <= region_keys(plan, region), region
        assert max(later.values()) == 1 and later.total() == 2 * BATCH, region
    added: Counter[str] = Counter(k for r in second if r["region"] == AP for k in r["keys"])
    assert not any(r["region"] == AP for r in first)
    assert max(added.values()) == 1 and added.total() == extra * BATCH <= per_added and set(added) <= region_keys(plan, AP)
