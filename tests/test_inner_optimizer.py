"""``--inner-optimizer adamw`` (the DiLoCo paper's inner optimizer: betas 0.9 and 0.95, weight
decay 0.1) with ``--warmup-steps``: checkpointed and resumed like the default SGD, bit for bit; a
checkpoint resumed with the other optimizer is one line, exit 2, and nothing is written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_loaders import EU, split
from test_trainer import latest, records, train

from geoshard.trainer.config import TrainConfig
from geoshard.trainer.optim import inner_optimizer, lr_at

GEOSHARD = str(Path(sys.executable).with_name("geoshard"))
STEPS = 20
ADAMW = ("--inner-optimizer", "adamw", "--lr", 4e-3, "--warmup-steps", 5, "--checkpoint-every", 10, "--log-keys")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split(tmp_path_factory.mktemp("corpus"), samples=3000)


def test_adamw_takes_the_papers_betas_and_the_warm_up_is_linear_then_flat(tmp_path: Path) -> None:
    cfg = TrainConfig(plan=tmp_path / "p.toml", out=tmp_path, steps=10, lr=4e-4, inner_optimizer="adamw", warmup_steps=4)
    opt = inner_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.1
    assert [lr_at(cfg, s) for s in range(6)] == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4, 4e-4, 4e-4])
    sgd = inner_optimizer(TrainConfig(plan=cfg.plan, out=tmp_path, steps=10), [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9


@pytest.mark.slow
def test_an_adamw_run_resumed_ends_bit_identical_to_an_uninterrupted_one_and_sgd_cannot_resume_it(plan: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    train(plan, a, "--steps", STEPS, *ADAMW)
    train(plan, b, "--steps", STEPS // 2, *ADAMW)
    log = train(plan, b, "--steps", STEPS, "--resume", *ADAMW)
    assert f"rank 0: resumed at step {STEPS // 2}" in log
    (step_a, state_a), (step_b, state_b) = latest(a), latest(b)
    assert step_a == step_b == STEPS and state_a["inner_optimizer"] == state_b["inner_optimizer"] == "adamw"
    for name, tensor in state_a["model"].items():
        assert torch.equal(tensor, state_b["model"][name]), name
    # AdamW's moments came through the checkpoint (SGD has none of them).
    opt_a, opt_b = state_a["optimizer"], state_b["optimizer"]
    assert opt_a["param_groups"][0]["betas"] == (0.9, 0.95) and opt_a["param_groups"][0]["lr"] == pytest.approx(4e-3)
    for i, s in opt_a["state"].items():
        assert s["exp_avg"].abs().sum() > 0 and torch.equal(s["exp_avg"], opt_b["state"][i]["exp_avg"])
        assert torch.equal(s["exp_avg_sq"], opt_b["state"][i]["exp_avg_sq"])
    for rank in (0, 1):
        ra, rb = records(a / f"steps-rank{rank}.jsonl"), records(b / f"steps-rank{rank}.jsonl")
        assert [r["loss"] for r in ra] == [r["loss"] for r in rb] and len(ra) == STEPS
    # The same checkpoints resumed with the default SGD: refused before anything is written.
    before = sorted(p.name for p in (b / "checkpoints").iterdir())
    argv = [GEOSHARD, "train", "--plan", str(plan), "--region", EU, "--out", str(b), "--nproc", "2", "--steps", str(STEPS + 10)]
    done = subprocess.run([*argv, "--resume", "--backend", "gloo"], capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr
    # Both ranks refuse; the line names whichever of them stopped first.
    [line] = done.stderr.splitlines()
    assert re.fullmatch(
        rf"geoshard: error: rank [01]: {re.escape(str(b / 'checkpoints'))}: the checkpoint of step {STEPS} was trained with "
        r"--inner-optimizer adamw, this run asks for sgd: resume with --inner-optimizer adamw, or start over in a new --out",
        line,
    ), line
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == before
    assert len(records(b / "steps-rank0.jsonl")) == STEPS
