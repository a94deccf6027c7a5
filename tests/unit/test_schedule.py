"""The inner learning-rate schedule: linear warmup, then cosine down to a floor."""

import pytest

from trainer.config import InnerConfig
from trainer.schedule import inner_lr


def test_schedule_warmup_then_cosine_to_floor():
    cfg = InnerConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert inner_lr(0, cfg) == pytest.approx(0.25) and inner_lr(3, cfg) == pytest.approx(1.0)
    assert inner_lr(4, cfg) == pytest.approx(1.0)
    assert inner_lr(9, cfg) == pytest.approx(0.55)
    assert inner_lr(14, cfg) == pytest.approx(0.1) and inner_lr(100, cfg) == pytest.approx(0.1)
    assert inner_lr(50, InnerConfig(lr=0.5, warmup_steps=2, total_steps=0)) == 0.5
