"""Model presets and init, tokenizer, corpus loading and the per-peer sampler."""

import pytest
import torch

from trainer.config import InnerConfig, ModelConfig
from trainer.model import GPT, PRESETS, build_model, context_length, decode, encode
from trainer.schedule import inner_lr


@pytest.mark.parametrize("preset, target", [("tiny", 1e6), ("small", 25e6), ("base", 125e6)])
def test_preset_parameter_counts(preset, target):
    # On the meta device nothing is allocated, so even base is instant.
    with torch.device("meta"):
        model = GPT(**PRESETS[preset])
    count = sum(p.numel() for p in model.parameters())
    assert 0.7 * target <= count <= 1.3 * target
    assert context_length(preset) == PRESETS[preset]["context"]


def test_same_seed_same_parameters_and_forward():
    a, b = build_model(ModelConfig(), 7), build_model(ModelConfig(), 7)
    c = build_model(ModelConfig(), 8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    assert a.lm_head.weight is a.wte.weight
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 256, (2, 2, 16), generator=gen)
    logits, loss = a(idx, targets)
    assert logits.shape == (2, 16, 256)
    # A fresh GPT-2 init predicts close to uniform over 256 bytes.
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    assert a(idx)[1] is None


def test_build_model_leaves_global_rng_alone():
    state = torch.get_rng_state()
    build_model(ModelConfig(), 1)
    assert torch.equal(state, torch.get_rng_state())


def test_byte_tokenizer_round_trip():
    text = "def f(x):\n    return 'ü' * x"
    tokens = encode(text)
    assert all(0 <= t < 256 for t in tokens) and decode(tokens) == text
    assert decode([0xFF, 0x41]) == "\ufffdA"


def test_schedule_warmup_then_cosine_to_floor():
    cfg = InnerConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert inner_lr(0, cfg) == pytest.approx(0.25) and inner_lr(3, cfg) == pytest.approx(1.0)
    assert inner_lr(4, cfg) == pytest.approx(1.0)
    assert inner_lr(9, cfg) == pytest.approx(0.55)
    assert inner_lr(14, cfg) == pytest.approx(0.1) and inner_lr(100, cfg) == pytest.approx(0.1)
    assert inner_lr(50, InnerConfig(lr=0.5, warmup_steps=2, total_steps=0)) == 0.5
