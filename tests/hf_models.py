"""Tiny Hugging Face model directories for the tests, built from configs (nothing downloaded)."""

from __future__ import annotations

import os

import torch


def tiny_config(arch: str = "qwen2", vocab_size: int = 320, **overrides):
    """A two-layer config of a real architecture: qwen2 ties its embeddings, llama does not."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    common.update(overrides)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=False, **common)
    raise ValueError(arch)


def build_model_dir(path, arch: str = "qwen2", *, weights: bool = True, seed: int = 0, tokenizer_dir: str | None = None,
                    **overrides) -> str:
    """Write a model directory (config.json, model.safetensors unless weights=False, and the
    tokenizer files of ``tokenizer_dir`` if given); returns its path."""
    from transformers import AutoModelForCausalLM

    path = str(path)
    os.makedirs(path, exist_ok=True)
    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if weights:
        model.save_pretrained(path, safe_serialization=True)
    else:
        config.save_pretrained(path)
    if tokenizer_dir is not None:
        import shutil

        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path
