"""Where models come from: the presets and local Hugging Face directories, and their init."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.hf_models import build_model_dir
from tests.unit.capabilities import assert_same_everywhere, by_capability, section
from trainer.config import ModelConfig
from trainer.model import PRESETS, check_source, decode, encode, lm_loss, load_model, preset_config


def params(loaded):
    return [p.detach().clone() for p in loaded.module.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("preset, target", [("tiny", 0.8e6), ("small", 25e6), ("base", 128e6)])
def test_preset_parameter_counts(preset, target):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(preset))
    n = sum(p.numel() for p in model.parameters())
    assert 0.9 * target < n < 1.1 * target
    assert preset_config(preset).max_position_embeddings == PRESETS[preset]["max_position_embeddings"]


def test_random_init_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = load_model(ModelConfig(), 7), load_model(ModelConfig(), 7)
    c = load_model(ModelConfig(), 8)
    assert torch.equal(torch.get_rng_state(), state)
    assert same(params(a), params(b)) and not same(params(a), params(c))
    weight = a.module.model.layers[0].self_attn.q_proj.weight
    assert abs(weight.std().item() - 0.02) < 0.002  # the architecture's own scheme (initializer_range)
    assert torch.equal(a.module.model.norm.weight, torch.ones(128))
    # A fresh init predicts close to uniform over the 256 bytes.
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert abs(lm_loss(a.module, x[:, :-1], x[:, 1:]).item() - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_tied_embeddings_and_rotary_buffers_come_out_right():
    from transformers import AutoModelForCausalLM

    loaded = load_model(ModelConfig(), 0)
    m = loaded.module
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert "lm_head.weight" not in loaded.param_names and len(loaded.param_names) == len(list(m.parameters()))
    # Rotary frequencies are buffers, not parameters: computed from the config, not drawn.
    head_dim = 128 // 4
    theta = loaded.config["rope_parameters"]["rope_theta"]
    expected = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    assert torch.allclose(m.model.rotary_emb.inv_freq, expected)
    reference = AutoModelForCausalLM.from_config(preset_config("tiny"))
    for (name, buf), (ref_name, ref) in zip(m.named_buffers(), reference.named_buffers()):
        assert name == ref_name and torch.equal(buf, ref), name
    # A step through the tied weight moves both ends.
    x = torch.randint(0, 256, (2, 16))
    lm_loss(m, x, x).backward()
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)
    assert torch.equal(m.model.embed_tokens.weight, m.lm_head.weight)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_pretrained_weights_load_exactly(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = build_model_dir(tmp_path / arch, arch)
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    loaded = load_model(ModelConfig(source=f"hf:{path}"), seed=123)
    assert loaded.vocab_size == 320 and loaded.context == 64 and not loaded.byte_level
    assert same(params(loaded), [p.detach() for p in reference.parameters()])
    tied = loaded.module.lm_head.weight is loaded.module.model.embed_tokens.weight
    assert tied == (arch == "qwen2")
    x = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        assert torch.equal(loaded.module(input_ids=x).logits, reference(input_ids=x).logits)
    assert loaded.config["model_type"] == arch


def test_random_init_from_an_hf_config(tmp_path):
    path = build_model_dir(tmp_path / "m", "qwen2", weights=False)
    cfg = ModelConfig(source=f"hf:{path}", init="random")
    a, b, c = load_model(cfg, 1), load_model(cfg, 1), load_model(cfg, 2)
    assert same(params(a), params(b)) and not same(params(a), params(c))
    assert a.module.lm_head.weight is a.module.model.embed_tokens.weight


def test_auto_init_needs_weights(tmp_path):
    path = build_model_dir(tmp_path / "m", "llama", weights=False)
    with pytest.raises(ValueError, match=r"^model.source: .*/m: no \*.safetensors weights"):
        check_source(ModelConfig(source=f"hf:{path}"))
    check_source(ModelConfig(source=f"hf:{path}", init="random"))


def test_bad_model_directories(tmp_path):
    def error(path, **kw) -> str:
        with pytest.raises(ValueError) as info:
            load_model(ModelConfig(source=f"hf:{path}", **kw), 0)
        message = str(info.value)
        assert "\n" not in message and message.startswith("model.source: ")
        return message

    assert "not a directory" in error(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in error(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert "config.json: not a usable model config" in error(tmp_path / "broken")
    (tmp_path / "vision").mkdir()
    from transformers import ViTConfig

    ViTConfig().save_pretrained(tmp_path / "vision")
    assert "is not a causal language model" in error(tmp_path / "vision")
    # Weights written for another shape than config.json says.
    path = build_model_dir(tmp_path / "shape", "llama")
    config = json.loads((tmp_path / "shape" / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "shape" / "config.json").write_text(json.dumps(config))
    assert "weights do not" in error(path)
    # A layer the config has but the weights lack.
    path = build_model_dir(tmp_path / "short", "llama")
    config["intermediate_size"], config["num_hidden_layers"] = 128, 3
    (tmp_path / "short" / "config.json").write_text(json.dumps(config))
    message = error(path)
    assert "weights do not match config.json" in message and "missing" in message


def test_byte_tokens_round_trip():
    text = "héllo, wörld\n"
    tokens = encode(text)
    assert all(0 <= t < 256 for t in tokens) and decode(tokens) == text
    assert decode([0xFF, 0x41]) == "\ufffdA"


def test_no_hub_access(tmp_path, monkeypatch):
    # A repo id instead of a directory is refused before transformers could look it up online.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_model(ModelConfig(source="hf:Qwen/Qwen2-0.5B"), 0)
    assert not os.path.exists(tmp_path / "Qwen")


INIT_CHILD = section("model_init", r"""
import hashlib, tempfile
from tests.hf_models import build_model_dir
from trainer.config import ModelConfig
from trainer.model import load_model

out = {}
with tempfile.TemporaryDirectory() as tmp:
    path = build_model_dir(tmp + "/m", "llama", weights=False)
    for name, source in (("tiny", "tiny"), ("llama", "hf:" + path)):
        m = load_model(ModelConfig(source=source, init="random"), 5).module
        h = hashlib.blake2b(digest_size=16)
        for p in m.parameters():
            h.update(p.detach().numpy().tobytes())
        out[name] = h.hexdigest()
""")


@pytest.mark.timeout(300)
def test_random_init_has_the_same_bits_on_every_cpu_kind():
    assert_same_everywhere(by_capability(INIT_CHILD))


def test_activation_checkpointing_gives_the_same_gradients():
    plain = load_model(ModelConfig(), 3).module
    checkpointed = load_model(ModelConfig(activation_checkpointing=True), 3).module
    assert checkpointed.is_activation_checkpointing and not plain.is_activation_checkpointing
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    for m in (plain, checkpointed):
        lm_loss(m, x[:, :-1], x[:, 1:]).backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_bf16_inner_steps_keep_fp32_parameters():
    from trainer.config import DataConfig, InnerConfig, OuterConfig
    from trainer.diloco import DiLoCoWorker

    corpus = torch.frombuffer(bytearray(b"autocast keeps the master weights in fp32. " * 300), dtype=torch.uint8)
    worker = DiLoCoWorker(model=ModelConfig(), data=DataConfig(batch_size=2, seq_len=32), inner=InnerConfig(precision="bf16"),
                          outer=OuterConfig(), corpus=corpus, shard_key="p", seed=0)
    assert worker.precision == "bf16"
    stats = worker.inner_steps(3)
    assert stats.steps == 3 and 0 < stats.mean_loss < 6
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())
    delta = worker.pseudo_gradient()
    assert all(d.dtype == torch.float32 and d.abs().sum() > 0 for d in delta[:3])
