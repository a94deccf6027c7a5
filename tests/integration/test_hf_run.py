"""The README's "Train a Hugging Face model" commands, end to end on a tiny model.

A tokenizer trained here, a Qwen2 model directory (tied embeddings), text
files -> prepare-data -> two peers training on the token shards -> export
while the first still runs, and again after -> transformers loads the export
offline and computes the node's logits.
"""

import signal
import subprocess

import pytest
import torch

from tests.hf_fixtures import build_tokenizer
from tests.hf_models import build_model_dir
from tests.integration.nodes import BIN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

TEXT = [
    "Peers train one language model together over the internet.\n" * 40,
    "def average(values):\n    return sum(values) / len(values)\n" * 40,
    "Every host runs gonka-node start and joins through any live peer.\n" * 40,
]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout)


def test_prepare_train_export_load(nodes, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = build_tokenizer(str(tmp_path / "tokenizer"), TEXT, vocab_size=320)
    model_dir = build_model_dir(tmp_path / "qwen-tiny", "qwen2", tokenizer_dir=tokenizer, vocab_size=320)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, text in enumerate(TEXT * 4):
        (texts / f"doc{i}.txt").write_text(text)

    out = run_cli("prepare-data", "--tokenizer", model_dir, "--out", str(tmp_path / "data"), str(texts))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "data" / "manifest.json").is_file()

    common = ["--model", f"hf:{model_dir}", "--data", str(tmp_path / "data"), "--inner-steps", "4",
              "--min-peers", "2", "--set", "data.seq_len=32", "--set", "data.eval_batches=2"]
    first = nodes("n1", *common, "--checkpoint-dir", str(tmp_path / "ckpt1"))
    second = nodes("n2", *common, "--bootstrap", first.address(), "--checkpoint-dir", str(tmp_path / "ckpt2"))
    first.wait_round(2, timeout=200)

    # Export works while the node runs, from its last complete checkpoint.
    live = run_cli("export", "--checkpoint-dir", str(tmp_path / "ckpt1"), "--out", str(tmp_path / "live"))
    assert live.returncode == 0, live.stderr
    assert first.proc.poll() is None

    second.wait_round(3, timeout=200)
    for n in (first, second):
        n.proc.send_signal(signal.SIGTERM)
    for n in (first, second):
        assert n.wait_exit(timeout=60) == 0, n.log()[-3000:]
    assert first.rounds()[2] == second.rounds()[2]

    out = run_cli("export", "--checkpoint-dir", str(tmp_path / "ckpt1"), "--out", str(tmp_path / "export"),
                  "--dtype", "fp32")
    assert out.returncode == 0, out.stderr
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True, dtype=torch.float32)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    ids = tok("Peers train one model", return_tensors="pt").input_ids

    # The node's own view of the same parameters: its checkpoint's θ in the model it trains.
    ckpt = torch.load(tmp_path / "ckpt1" / "latest.pt", map_location="cpu", weights_only=True)
    from trainer.config import ModelConfig
    from trainer.model import load_model

    node_model = load_model(ModelConfig(source=f"hf:{model_dir}"), 0).module
    with torch.no_grad():
        for p, g in zip(node_model.parameters(), ckpt["worker"]["global_params"]):
            p.copy_(g)
        assert torch.equal(exported(input_ids=ids).logits, node_model(input_ids=ids).logits)
        original = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        assert not torch.equal(original(input_ids=ids).logits, node_model(input_ids=ids).logits)  # it trained
