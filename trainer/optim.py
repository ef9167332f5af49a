"""The inner optimizer: SGD with momentum 0.9 (the default), or AdamW as the DiLoCo paper trains
(betas 0.9 and 0.95, weight decay 0.1, at --lr 4e-4 there), with an optional linear warm-up.

The warm-up is a function of the step alone, set before every optimizer step, so a resumed run
needs nothing beyond the optimizer's own state: its learning rate at step s is the same whether
the run was interrupted or not. A checkpoint records which optimizer wrote it; resuming it with the
other one is refused (their states do not convert)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from geoshard.errors import ConfigError
from geoshard.trainer.config import TrainConfig

ADAMW_BETAS = (0.9, 0.95)  # the DiLoCo paper's (and most LLM recipes')
SGD_MOMENTUM = 0.9


def inner_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.inner_optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear from lr/warmup up to lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def set_lr(opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> None:
    if cfg.warmup_steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)


def check_resumed(cfg: TrainConfig, state: Mapping[str, Any], where: str, step: int) -> None:
    """A checkpoint's optimizer is the one this run asks for (checkpoints from before the option: SGD)."""
    saved = state.get("inner_optimizer", "sgd")
    if saved != cfg.inner_optimizer:
        shown = saved if isinstance(saved, str) and saved.isidentifier() else repr(saved)[:40]
        raise ConfigError(
            f"{where}: the checkpoint of step {step} was trained with --inner-optimizer {shown}, this run asks for "
            f"{cfg.inner_optimizer}: resume with --inner-optimizer {shown}, or start over in a new --out"
        )
