"""`gonka-node start` with a bad model directory or dataset: one line naming the path and
what is wrong, exit code 2, and nothing left running."""

import json
import os
import subprocess

import pytest

from tests.hf_fixtures import build_tokenizer
from tests.hf_models import build_model_dir
from tests.integration.nodes import BIN, FAST, children_of, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A model (vocab 320), a dataset of its tokenizer, and a dataset of a bigger tokenizer."""
    root = tmp_path_factory.mktemp("bad-input")
    text = root / "text.txt"
    text.write_text("Peers train one language model together over the internet.\n" * 400)
    model = build_model_dir(root / "model", "qwen2", tokenizer_dir=build_tokenizer(str(root / "tok")), vocab_size=320)
    big = build_tokenizer(str(root / "big-tok"), vocab_size=400)
    for tokenizer, out in ((model, root / "data"), (big, root / "data-big")):
        done = subprocess.run([str(BIN), "prepare-data", "--tokenizer", tokenizer, "--out", str(out), str(text),
                               "--no-progress"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    return root


def copy_dataset(src, dst):
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def start(tmp_path, model: str, data: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN), "start", *FAST, "--control", "off", "--model", model, "--data", data, "--max-rounds", "1",
           "--set", "data.seq_len=32", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        for pid in children_of(proc.pid):
            os.kill(pid, 9)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_in_process(capsys, model: str, data: str) -> tuple[int, str]:
    """The same `gonka-node start`, in this process: every case here fails in its start-up
    checks, and a process each would pay a node's imports (transformers' among them) again.
    Returns the exit code and what it wrote to stderr."""
    import torch

    from node.cli import main

    threads = torch.get_num_threads()  # a node's start-up sets its own
    capsys.readouterr()
    try:
        code = main(["start", *FAST, "--control", "off", "--model", model, "--data", data, "--max-rounds", "1",
                     "--set", "data.seq_len=32"])
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


def shard_of(directory) -> str:
    return json.loads((directory / "manifest.json").read_text())["shards"][0]["file"]


def test_bad_models_and_datasets_exit_2_naming_the_path(prepared, tmp_path, capsys, monkeypatch):
    root = prepared
    (tmp_path / "no-config").mkdir()
    (tmp_path / "vision").mkdir()
    (tmp_path / "vision" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    wrong = build_model_dir(tmp_path / "wrong-shape", "qwen2", vocab_size=320)
    config = json.loads((tmp_path / "wrong-shape" / "config.json").read_text())
    config["hidden_size"] = 32
    (tmp_path / "wrong-shape" / "config.json").write_text(json.dumps(config))

    bad_magic = copy_dataset(root / "data", tmp_path / "bad-magic")
    shard = bad_magic / shard_of(bad_magic)
    shard.write_bytes(b"NOTATOKN" + shard.read_bytes()[8:])
    truncated = copy_dataset(root / "data", tmp_path / "truncated")
    shard = truncated / shard_of(truncated)
    shard.write_bytes(shard.read_bytes()[:-10])
    wrong_hash = copy_dataset(root / "data", tmp_path / "wrong-hash")
    manifest = json.loads((wrong_hash / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = "0" * 64
    (wrong_hash / "manifest.json").write_text(json.dumps(manifest))
    wrong_count = copy_dataset(root / "data", tmp_path / "wrong-count")
    manifest = json.loads((wrong_count / "manifest.json").read_text())
    manifest["shards"][0]["tokens"] += 1
    manifest["total_tokens"] += 1
    (wrong_count / "manifest.json").write_text(json.dumps(manifest))

    model, data = f"hf:{root / 'model'}", str(root / "data")
    cases = [
        (f"hf:{tmp_path / 'no-config'}", data, str(tmp_path / "no-config"), "no config.json"),
        (f"hf:{tmp_path / 'vision'}", data, "config.json", "not a causal language model"),
        (f"hf:{wrong}", data, str(tmp_path / "wrong-shape"), "weights do not"),
        (model, str(root / "data-big"), str(root / "data-big"), "more than the vocab_size 320"),
        (model, str(bad_magic), str(bad_magic), "magic"),
        (model, str(truncated), str(truncated), "truncated"),
        (model, str(wrong_hash), str(wrong_hash), "sha256"),
        (model, str(wrong_count), str(wrong_count), "tokens"),
    ]
    for var in [v for v in os.environ if v.startswith("GONKA_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    before = set(children_of(os.getpid()))
    for model_arg, data_arg, names, says in cases:
        code, err = start_in_process(capsys, model_arg, data_arg)
        errors = [line for line in err.splitlines() if line.startswith("gonka-node: error:")]
        assert code == 2, (model_arg, data_arg, err[-2000:])
        assert len(errors) == 1, err[-2000:]
        assert names in errors[0] and says in errors[0], errors[0]
    # Text read as bytes is for the byte-level presets only.
    code, err = start_in_process(capsys, model, str(root / "text.txt"))
    assert code == 2 and "prepare-data" in err.splitlines()[-1], err[-2000:]
    # Nothing a refused start began (p2pd, for the checks that need the model) is left running.
    wait_until(lambda: set(children_of(os.getpid())) <= before, 30, "the refused starts' children to exit")
    # And through the CLI as a user runs it, once: the same line, exit 2, nothing left.
    out = start(tmp_path, *cases[4][:2])
    assert out.returncode == 2 and cases[4][3] in out.stderr.splitlines()[-1], out.stderr[-2000:]


def test_a_corrupt_shard_found_while_training_stops_the_node_with_exit_1(prepared, tmp_path):
    corrupt = copy_dataset(prepared / "data", tmp_path / "corrupt")
    shard = corrupt / shard_of(corrupt)
    data = bytearray(shard.read_bytes())
    data[-2:] = b"\xff\x00"  # a token changed: header and size still right
    shard.write_bytes(bytes(data))
    out = start(tmp_path, f"hf:{prepared / 'model'}", str(corrupt), "--set", "data.verify=background",
                "--max-rounds", "1000", "--inner-steps", "200")
    assert out.returncode == 1, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("gonka-node: error:")]
    assert len(errors) == 1 and str(shard) in errors[0] and "sha256" in errors[0], out.stderr[-2000:]
    # The same dataset with the default (verify at start) is refused before training: exit 2.
    out = start(tmp_path, f"hf:{prepared / 'model'}", str(corrupt))
    assert out.returncode == 2 and "sha256" in out.stderr, out.stderr[-2000:]
