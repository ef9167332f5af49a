"""Run by torchrun in tests/test_own_loop.py: the README's StepLog loop as written there, with
``max_steps`` of ``sys.argv[2]``, a small model and a ``train_step`` that returns a loss tensor
which requires grad (what a user's step returns). The current folder holds ``plan.toml``."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch


def readme_loop(readme: Path) -> str:
    """The README's python block that uses StepLog."""
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    return next(b for b in blocks if "StepLog(" in b)


def main() -> None:
    code = readme_loop(Path(sys.argv[1]))
    assert code.count("max_steps=1000") == 1, code
    code = code.replace("max_steps=1000", f"max_steps={int(sys.argv[2])}")
    model = torch.nn.Linear(8, 10)

    def train_step(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        x = torch.tensor([[b[i] / 255 for i in range(8)] for b in batch["jpg"]])
        y = torch.tensor([int(c) for c in batch["cls"]])
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    exec(compile(code, "README.md", "exec"), {"model": model, "train_step": train_step})  # noqa: S102 - the README's own code


if __name__ == "__main__":
    main()
