"""`gonka-node plan` (trainer/plan.py): sizes from the node's own sharding of a model built on
the meta device, the modes that fit a 70B Llama on 8 x H100 and H200 hosts, the CLI's output
and bad input, and `start` refusing a model its host cannot hold before loading anything."""

import json

import pytest
import torch

from node.cli import main
from trainer.config import ModelConfig
from trainer.model import load_model
from trainer.parallel import replica_slice
from trainer.plan import GiB, Hardware, Run, model_shape, plan_run

pytestmark = pytest.mark.timeout(120)

LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    """A 70B Llama-style model directory: config.json only (the plan reads no weights)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama70b")
    LlamaConfig(**LLAMA_70B).save_pretrained(path)
    return f"hf:{path}"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shape_is_the_nodes_own_sharding_of_the_model(world):
    shape = model_shape("tiny", world)
    module = load_model(ModelConfig(source="tiny"), 0).module
    params = list(module.parameters())
    assert shape.params == sum(p.numel() for p in params)
    # The largest rank's rows, as FSDP2 (and a DDP rank's outer state) slices each parameter.
    assert shape.rank_params == max(sum(replica_slice(p, r, world).numel() for p in params) for r in range(world))
    blocks = module.model.layers
    assert shape.layers == len(blocks)
    assert shape.block_params == sum(p.numel() for p in blocks[0].parameters())


def test_a_70b_llama_fits_8xh100_only_in_bf16_with_8bit_adamw_and_checkpointing(llama70b):
    run = Run(batch_size=1, seq_len=4096, inner_steps=500, codec="int8", loss_chunk=2048)
    plan = plan_run(llama70b, Hardware(), run)
    assert 70.5e9 < plan.shape["params"] < 70.6e9
    fits = {(m.mode, m.activation_checkpointing) for m in plan.modes if m.fits}
    assert fits == {("bf16 + 8-bit AdamW", True)}, fits
    best = plan.recommended
    assert best.settings["inner.param_dtype"] == "bf16" and best.settings["inner.optimizer_state"] == "8bit"
    # Sharded 8 ways: 2 + 2 + 2.03 bytes a parameter of the largest rank's 8.82B.
    assert best.gpu["parameters"] == best.gpu["gradients"] == 2 * plan.shape["rank_params"]
    assert best.gpu_total < 80 * GiB
    assert 0 < best.utilization < best.utilization_overlapped <= 1
    # Halving the link doubles the exchange: utilization without overlap falls.
    slow = plan_run(llama70b, Hardware(link_bps=1e8), run)
    assert slow.recommended.utilization < best.utilization
    assert slow.sync["int8"]["seconds"] > 9 * plan.sync["int8"]["seconds"]
    # H200 (141 GiB) holds more precise modes; the recommendation is the fastest that fits.
    h200 = plan_run(llama70b, Hardware(gpu_memory=141 * GiB), run)
    assert h200.recommended.mode == "fp32 + 8-bit AdamW" and h200.recommended.activation_checkpointing


def test_plan_cli_prints_text_and_json(llama70b, capsys):
    assert main(["plan", "--model", llama70b, "--batch-size", "1", "--seq-len", "4096", "--loss-chunk", "2048",
                 "--codec", "int8", "--link", "100mbit"]) == 0
    text = capsys.readouterr().out
    assert "70.55B parameters" in text and "<- recommended" in text and "link 100 Mbit/s" in text
    assert main(["plan", "--model", llama70b, "--gpu", "h200", "--json", "--inner-steps", "100", "--batch-size", "1",
                 "--codec", "int8", "--seq-len", "4096"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"] and plan["run"]["inner_steps"] == 100 and plan["hardware"]["gpu_memory"] == 141 * GiB


@pytest.mark.parametrize("args, message", [
    (["--link", "fast"], "--link: expected a link rate"),
    (["--model", "hf:/no/such/dir"], "model.source: /no/such/dir: not a directory"),
    (["--codec", "zip"], "--codec: must be one of"),
    (["--set", "inner.param_dtype=fp8"], "inner.param_dtype: must be one of"),
])
def test_plan_bad_input_is_one_line_and_exit_2(args, message, capsys):
    try:
        code = main(["plan", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_start_refuses_a_model_its_host_cannot_hold_before_loading_anything(llama70b, capsys, monkeypatch):
    loaded = []
    monkeypatch.setattr("trainer.model.load_model", lambda *a, **k: loaded.append(a))
    code = main(["start", "--model", llama70b, "--device", "cpu", "--control", "off", "--metrics-addr", "off"])
    err = capsys.readouterr().err
    assert code == 2 and not loaded, err
    assert err.count("\n") == 1 and "model.source: " in err and "does not fit" in err and "GiB of host memory" in err
    assert torch.get_num_threads() >= 1


def test_scale_doc_is_what_plan_says():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "scripts" / "scaledoc.py"), "--check"], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr
