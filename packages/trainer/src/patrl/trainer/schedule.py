"""Learning-rate schedule: linear warmup, then constant or cosine decay."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from patrl.trainer.config import OptimConfig


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of `cfg.lr` for optimizer step `step` (0-based)."""
    warmup = cfg.num_warmup_steps
    if step < warmup:
        # (step + 1): the first step already learns instead of wasting a step at lr 0.
        return (step + 1) / warmup
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    assert cfg.total_training_steps is not None  # build_scheduler checked the horizon
    span = max(cfg.total_training_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: Optimizer, cfg: OptimConfig) -> LambdaLR:
    """The schedule of `cfg`; ValueError when it needs total_training_steps and has none."""
    cfg.check_horizon()
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
