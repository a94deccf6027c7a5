"""The presets built without transformers are transformers' LlamaForCausalLM, bit for bit:
parameters from a seed, logits, loss and gradients, with and without activation checkpointing;
and a node training a preset never imports transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trainer import model as models
from trainer.config import ModelConfig
from trainer.presets import PresetLlama

pytestmark = pytest.mark.timeout(120)


def reference(name: str, seed: int, checkpointing: bool = False):
    """The same preset built by transformers, initialised by the same seeded draws."""
    module = models._empty_model(models.preset_config(name), on_meta=False)
    models._initialise(module, seed, sharded=False)
    if checkpointing:
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return module.train()


@pytest.mark.parametrize("name, checkpointing", [("tiny", False), ("tiny", True), ("small", False)])
def test_a_preset_is_transformers_llama_bit_for_bit(name, checkpointing):
    ours = models.load_model(ModelConfig(source=name, activation_checkpointing=checkpointing), 7).module
    theirs = reference(name, 7, checkpointing)
    assert isinstance(ours, PresetLlama)
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert list(a) == list(b)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    for (n, x), (m, y) in zip(ours.named_buffers(), theirs.named_buffers(), strict=True):
        assert n == m and torch.equal(x, y), n
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    mine, ref = (models.lm_loss(m, x[:, :-1], x[:, 1:]) for m in (ours, theirs))
    assert torch.equal(mine, ref), (mine.item(), ref.item())
    mine.backward()
    ref.backward()
    assert [n for n in a if not torch.equal(a[n].grad, b[n].grad)] == []


def test_the_preset_config_is_one_transformers_builds_the_same_model_from():
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = models.load_model(ModelConfig(source="tiny"), 3)
    fields = dict(loaded.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    theirs = AutoModelForCausalLM.from_config(config)
    theirs.load_state_dict(loaded.module.state_dict())
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(theirs(input_ids=x).logits, loaded.module(input_ids=x).logits)


def test_a_node_training_a_preset_never_imports_transformers():
    script = (
        "import sys, asyncio\n"
        "import node.daemon\n"
        "from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig\n"
        "from trainer.data import open_source\n"
        "from trainer.diloco import DiLoCoWorker\n"
        "w = DiLoCoWorker(model=ModelConfig(), data=DataConfig(batch_size=2, seq_len=16), inner=InnerConfig(),\n"
        "                 outer=OuterConfig(), corpus=open_source([], verify=False), shard_key='a', seed=0)\n"
        "w.inner_steps(2, lambda: False)\n"
        "w.fingerprint('fp32', 'x')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
