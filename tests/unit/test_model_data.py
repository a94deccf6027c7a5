"""Model presets and init, tokenizer, corpus loading and the per-peer sampler."""

import os

import pytest
import torch

from trainer.config import InnerConfig, ModelConfig
from trainer.data import ShardSampler, default_corpus_paths, load_corpus
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


def test_default_corpus_is_sorted_stdlib_source():
    paths = default_corpus_paths()
    assert len(paths) > 100 and paths == sorted(paths)
    assert all(p.endswith(".py") and "site-packages" not in p for p in paths)
    assert any(p.endswith(os.sep + "os.py") for p in paths)


def test_load_corpus_joins_files_and_directories(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_bytes(b"bb")
    (tmp_path / "d" / "sub" / "a.txt").write_bytes(b"aa")
    (tmp_path / "c.txt").write_bytes(b"cc")
    corpus = load_corpus([str(tmp_path / "c.txt"), str(tmp_path / "d")])
    assert corpus.dtype == torch.uint8 and bytes(corpus.tolist()) == b"cc\nbb\naa"


def test_bad_paths_are_reported(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_bytes(b"")
    for paths in ([str(tmp_path / "missing")], [str(tmp_path / "empty")], [str(tmp_path / "blank.txt")]):
        with pytest.raises(ValueError, match=r"^data\.paths: "):
            load_corpus(paths)
    with pytest.raises(ValueError, match=r"^data\.paths: corpus too small"):
        ShardSampler(torch.zeros(100, dtype=torch.uint8), shard_key="a", seed=0, batch_size=2, seq_len=32, eval_fraction=0.1)


def split_corpus(n=20000, eval_fraction=0.1):
    # Training bytes are < 128 and held-out bytes >= 128, so a batch shows where it came from.
    gen = torch.Generator().manual_seed(0)
    corpus = torch.randint(0, 128, (n,), generator=gen, dtype=torch.uint8)
    corpus[n - int(n * eval_fraction):] += 128
    return corpus


def sampler(corpus, key, seed=0):
    return ShardSampler(corpus, shard_key=key, seed=seed, batch_size=4, seq_len=32, eval_fraction=0.1)


def test_shards_differ_and_eval_is_shared_and_held_out():
    corpus = split_corpus()
    a, b = sampler(corpus, "peer-a"), sampler(corpus, "peer-b")
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert xa.shape == ya.shape == (4, 32) and xa.dtype == torch.long
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(xa, xb)
    assert torch.equal(sampler(corpus, "peer-a").next_batch()[0], xa)
    assert not torch.equal(sampler(corpus, "peer-a", seed=1).next_batch()[0], xa)
    for _ in range(200):
        x, y = a.next_batch()
        assert x.max() < 128 and y.max() < 128
    ea, eb = a.eval_batches(3), b.eval_batches(3)
    assert len(ea) == 3
    for (x1, y1), (x2, y2) in zip(ea, eb):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.min() >= 128 and y1.min() >= 128
    assert a.eval_start == len(corpus) - 2000


def test_resumed_sampler_yields_the_same_batches():
    corpus = split_corpus()
    a = sampler(corpus, "peer-a")
    for _ in range(5):
        a.next_batch()
    b = sampler(corpus, "peer-a")
    b.load_state_dict(a.state_dict())
    assert b.batches_drawn == 5
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
