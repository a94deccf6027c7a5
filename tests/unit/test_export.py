"""`gonka-node export`: θ of a checkpoint becomes a Hugging Face directory that transformers loads offline.

Tiny Llama and Qwen2 models are built from configs here, their parameters
written as a node's checkpoint, exported, loaded back with from_pretrained and
compared by their logits. Bad checkpoints are refused with one line naming
the file, and nothing is left at --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from node.cli import main
from node.export_cmd import parse_size
from tests.hf_fixtures import build_tokenizer
from trainer.checkpoint import save_checkpoint
from trainer.export import export_checkpoint, plan_shards, shard_file_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 320  # build_tokenizer's default vocabulary


def llama_config(**overrides) -> LlamaConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaConfig(**(fields | overrides))


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True)


def build_model(config, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def node_state(model, *, rounds: int = 7, tokenizer_dir: str | None = None) -> dict:
    """A checkpoint as the node writes it, with θ = the model's parameters and the other
    entries (local copy, optimizer state, sampler) that export must ignore."""
    theta = [p.detach().clone() for p in model.parameters()]
    return {
        "run_id": "test-run",
        "worker": {
            "round": rounds,
            "inner_step": rounds * 4,
            "global_params": theta,
            "local_params": [t + 1 for t in theta],
            "inner_opt": {"state": {i: {"exp_avg": torch.zeros_like(t)} for i, t in enumerate(theta)}},
            "sampler": {"epoch": 1, "position": 12},
        },
        "model": {
            "source": "hf:/nowhere",
            "config": model.config.to_dict(),
            "param_names": [name for name, _ in model.named_parameters()],
            "tokenizer_dir": tokenizer_dir,
        },
    }


def write_checkpoint(directory, state) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "latest.pt")
    torch.save(state, path)
    return path


def logits(model) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def load(out):
    return AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)


@pytest.mark.timeout(60)
def test_fp32_export_of_llama_loads_offline_with_the_same_logits(tmp_path):
    model = build_model(llama_config())
    write_checkpoint(tmp_path / "ckpt", node_state(model, rounds=7))
    (tmp_path / "out").mkdir()  # an empty directory may be the target

    result = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"), dtype="fp32")

    assert result.files == ("config.json", "model.safetensors")
    assert sorted(os.listdir(tmp_path / "out")) == list(result.files)
    numel = sum(p.numel() for p in model.parameters())
    assert (result.round, result.run_id, result.parameters, result.bytes) == (7, "test-run", numel, numel * 4)
    loaded = load(tmp_path / "out")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert torch.equal(logits(loaded), logits(model))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == {name for name, _ in model.named_parameters()}
    modes = {(tmp_path / "out" / name).stat().st_mode for name in result.files}
    assert len(modes) == 1  # the weights are as readable as config.json, not safetensors' 0600
    # Only the temporary directory's rename touched the parent: nothing else is left there.
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"]


@pytest.mark.timeout(60)
def test_bf16_export_of_tied_qwen2_stays_tied_and_rounds_each_weight_once(tmp_path):
    model = build_model(qwen2_config())
    write_checkpoint(tmp_path / "ckpt", node_state(model))

    result = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))

    assert result.dtype == "bf16" and result.bytes == result.parameters * 2
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["dtype"], config["architectures"], config["tie_word_embeddings"]) == (
        "bfloat16", ["Qwen2ForCausalLM"], True)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    loaded = load(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()

    rounded = build_model(qwen2_config())
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert torch.equal(logits(loaded), logits(rounded))
    exact = logits(model)
    assert (logits(loaded) - exact).abs().max() <= 0.05 * exact.abs().max()


@pytest.mark.timeout(60)
def test_small_max_shard_size_writes_shards_and_an_index_transformers_loads(tmp_path):
    model = build_model(qwen2_config())
    write_checkpoint(tmp_path / "ckpt", node_state(model))
    limit = 40_000

    result = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"), dtype="fp32", max_shard_bytes=limit)

    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards == shard_file_names(len(shards))
    assert "model.safetensors" not in result.files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_parameters": result.parameters, "total_size": result.bytes}
    assert list(index["weight_map"]) == sorted(name for name, _ in model.named_parameters())
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        with safe_open(str(tmp_path / "out" / shard), "pt") as f:
            names = list(f.keys())
            sizes = [f.get_slice(n).get_shape() for n in names]
        assert all(index["weight_map"][n] == shard for n in names)
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= limit or len(names) == 1  # only a single oversized tensor may exceed it
    assert torch.equal(logits(load(tmp_path / "out")), logits(model))


def test_plan_shards_keeps_order_and_gives_an_oversized_tensor_its_own_shard():
    sizes = [("a", 30), ("b", 50), ("c", 200), ("d", 10), ("e", 90), ("f", 5)]
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert plan_shards(sizes, 10**9) == [["a", "b", "c", "d", "e", "f"]]
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_max_shard_size_takes_transformers_units():
    assert [parse_size(t) for t in ("5GB", "500MiB", "1.5GB", "100KB", "2KiB", "4096", "7b")] == [
        5 * 10**9, 500 * 2**20, 1_500_000_000, 100_000, 2048, 4096, 7]
    for bad in ("", "0", "0.1", "GB", "5XB", "-1MB", "5 G B"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
            parse_size(bad)


@pytest.mark.timeout(60)
def test_the_runs_tokenizer_files_are_copied_and_load(tmp_path):
    tokenizer_dir = build_tokenizer(str(tmp_path / "tokenizer"))
    model = build_model(llama_config())
    write_checkpoint(tmp_path / "ckpt", node_state(model, tokenizer_dir=tokenizer_dir))

    result = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))

    copied = sorted(os.listdir(tokenizer_dir))
    assert copied and set(copied) <= set(result.files)
    for name in copied:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "tokenizer" / name).read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    ids = tokenizer("def add(a, b):")["input_ids"]
    assert ids and max(ids) < VOCAB
    assert logits(load(tmp_path / "out")).shape[-1] == VOCAB


def run_cli(*args: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
    environ["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=90)


@pytest.mark.timeout(120)
def test_cli_exports_end_to_end_and_refuses_bad_input_with_one_line(tmp_path):
    model = build_model(llama_config(tie_word_embeddings=True))
    write_checkpoint(tmp_path / "ckpt", node_state(model, rounds=3))
    out = tmp_path / "exported" / "model"

    done = run_cli("export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out),
                   "--dtype", "fp32", "--max-shard-size", "100KB")

    assert done.returncode == 0, done.stderr
    assert "round 3" in done.stdout and str(out) in done.stdout and "model.safetensors.index.json" in done.stdout
    assert torch.equal(logits(load(out)), logits(model))

    refused = run_cli("export", "--checkpoint-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "other"))
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [refused.stderr.strip()]
    assert str(tmp_path / "missing" / "latest.pt") in refused.stderr
    assert not (tmp_path / "other").exists()


class Unsafe:
    """Not a type weights_only loading accepts."""


def _set(keys, value):
    def change(state):
        target = state
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return change


def _delete(*keys):
    def change(state):
        target = state
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return change


def _tensor(index, make):
    def change(state):
        params = state["worker"]["global_params"]
        params[index] = make(params[index])
    return change


# (id, change to a good checkpoint state, or the raw object to save, words the one line must contain)
BAD_CHECKPOINTS = [
    ("not-a-dict", [1, 2], ["not a checkpoint", "list"]),
    ("unsafe-object", {"run_id": datetime.date(2020, 1, 1)}, ["not a checkpoint of plain tensors"]),
    ("no-model", _delete("model"), ["no model entry"]),
    ("model-not-dict", _set(["model"], "tiny"), ["no model entry"]),
    ("config-not-dict", _set(["model", "config"], "llama"), ["model.config"]),
    ("no-model-type", _delete("model", "config", "model_type"), ["model_type"]),
    ("unknown-model-type", _set(["model", "config", "model_type"], "no-such-arch"), ["model.config", "no-such-arch"]),
    ("names-not-strings", _set(["model", "param_names"], [1, 2]), ["param_names"]),
    ("tokenizer-dir-not-path", _set(["model", "tokenizer_dir"], 5), ["tokenizer_dir"]),
    ("tokenizer-dir-missing", _set(["model", "tokenizer_dir"], "/nonexistent/tok"), ["/nonexistent/tok"]),
    ("no-run-id", _delete("run_id"), ["run_id"]),
    ("no-worker", _delete("worker"), ["worker"]),
    ("round-not-int", _set(["worker", "round"], "7"), ["worker.round"]),
    ("params-not-list", _set(["worker", "global_params"], torch.zeros(3)), ["global_params"]),
    ("count-mismatch", lambda s: s["worker"]["global_params"].pop(), ["param_names but"]),
    ("not-a-tensor", _tensor(0, lambda t: t.tolist()), ["model.embed_tokens.weight", "not a tensor"]),
    ("integer-tensor", _tensor(0, lambda t: t.long()), ["model.embed_tokens.weight", "floating point"]),
    ("wrong-shape", _tensor(-1, lambda t: torch.zeros(t.numel() + 1)), ["shape"]),
    ("unknown-name", _set(["model", "param_names", 0], "model.embed.weight"), ["missing", "unexpected",
                                                                               "model.embed.weight"]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad, words", [(b, w) for _, b, w in BAD_CHECKPOINTS], ids=[i for i, _, _ in BAD_CHECKPOINTS])
def test_a_bad_checkpoint_is_one_line_naming_it_exit_2_and_no_out(tmp_path, capsys, bad, words):
    if callable(bad):
        state = node_state(build_model(llama_config()))
        bad(state)
    else:
        state = bad
    path = write_checkpoint(tmp_path / "ckpt", state)

    code = main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])

    err = capsys.readouterr().err
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"gonka-node: error: export: {path}: "), err
    for word in words:
        assert word in err, err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["garbage", "missing", "out-not-empty", "out-is-file", "bad-dtype",
                                  "bad-shard-size", "no-out"])
def test_bad_files_and_flags_are_one_line_exit_2(tmp_path, capsys, case):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    path = write_checkpoint(ckpt, node_state(build_model(llama_config())))
    args = ["export", "--checkpoint-dir", str(ckpt), "--out", str(out)]
    named = path
    if case == "garbage":
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        words = ["cannot load"]
    elif case == "missing":
        os.unlink(path)
        words = ["no such file"]
    elif case == "out-not-empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        named, words = str(out), ["not empty"]
    elif case == "out-is-file":
        out.write_text("mine")
        named, words = str(out), ["not a directory"]
    elif case == "bad-dtype":
        args += ["--dtype", "fp16"]
        named, words = "--dtype", ["fp16"]
    elif case == "bad-shard-size":
        args += ["--max-shard-size", "0MB"]
        named, words = "--max-shard-size", ["0MB"]
    else:
        args = args[:3]
        named, words = "--out", []
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    code = main(args)

    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and named in err, err
    assert all(word in err for word in words), err
    # Nothing written, nothing changed: the user's files at --out are untouched.
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


@pytest.mark.timeout(60)
def test_a_checkpoint_replaced_while_being_read_is_read_again(tmp_path, monkeypatch):
    """The node renames a new latest.pt over the old one at any time; export must take
    one whole file, here the newer one, not the index of one and the data of the other."""
    older, newer = build_model(llama_config(), seed=1), build_model(llama_config(), seed=2)
    write_checkpoint(tmp_path / "ckpt", node_state(older, rounds=1))
    real_load, loads = torch.load, []

    def load_then_node_saves(*args, **kwargs):
        state = real_load(*args, **kwargs)
        loads.append(1)
        if len(loads) == 1:
            save_checkpoint(str(tmp_path / "ckpt"), node_state(newer, rounds=2))
        return state

    monkeypatch.setattr(torch, "load", load_then_node_saves)
    result = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"), dtype="fp32")
    monkeypatch.undo()

    assert len(loads) == 2 and result.round == 2
    assert torch.equal(logits(load(tmp_path / "out")), logits(newer))


CHILD = textwrap.dedent("""
    import json, sys, time
    from transformers import LlamaForCausalLM  # the modelling code, imported before the baseline
    from trainer.export import export_checkpoint

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one
    before = status("VmRSS")
    start = time.monotonic()
    result = export_checkpoint(sys.argv[1], sys.argv[2], dtype="bf16", max_shard_bytes=16 * 2**20)
    print(json.dumps({"seconds": time.monotonic() - start, "files": len(result.files),
                      "growth": status("VmHWM") - before}))
""")


@pytest.mark.timeout(180)
def test_export_reads_the_checkpoint_memory_mapped(tmp_path):
    # θ of ~54 MB in a ~215 MB checkpoint (θ, the local copy, two Adam moments), as on a node.
    config = llama_config(vocab_size=8000, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                          num_key_value_heads=8)
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    generator = torch.Generator().manual_seed(0)
    theta = [torch.randn(shape, generator=generator) * 0.02 for _, shape in shapes]
    state = {
        "run_id": "big",
        "worker": {"round": 1, "global_params": theta, "local_params": [t.clone() for t in theta],
                   "inner_opt": {"exp_avg": [t.clone() for t in theta], "exp_avg_sq": [t.clone() for t in theta]}},
        "model": {"source": "hf:/nowhere", "config": config.to_dict(), "param_names": [n for n, _ in shapes],
                  "tokenizer_dir": None},
    }
    path = write_checkpoint(tmp_path / "ckpt", state)
    del state, theta
    size = os.path.getsize(path)
    assert size > 200e6

    environ = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ckpt"), str(tmp_path / "out")],
                           capture_output=True, text=True, env=environ, cwd=ROOT, timeout=150)

    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    print(f"export of a {size / 1e6:.0f} MB checkpoint: {report}")
    assert report["files"] > 3  # several 16 MiB shards, written one at a time
    # Loading the checkpoint whole would alone grow the process by `size`; mapped, it
    # grows by θ's pages (a quarter of it) and one converted shard.
    assert report["growth"] < 0.6 * size, report
