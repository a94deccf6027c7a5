"""Learning-rate schedule of the inner AdamW.

The step counts inner steps over the whole run (across outer rounds), so a
peer that resumes or joins mid-run continues the same curve.
"""

from __future__ import annotations

import math

from trainer.config import InnerConfig


def inner_lr(step: int, cfg: InnerConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr_ratio * cfg.lr."""
    if step < cfg.warmup_steps:
        # step + 1 so the very first step already moves the weights.
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.total_steps == 0:
        return cfg.lr
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
