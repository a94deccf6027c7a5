"""`gonka-node prepare-data`: text and JSONL in, a token dataset out; bad input named in one line."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.hf_fixtures import build_tokenizer
from trainer import prepare
from trainer.prepare import InputError, PrepareConfig, prepare_dataset
from trainer.tokens import MANIFEST, open_token_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok") / "tokenizer"))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "node.cli", "prepare-data", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def encode(tokenizer_dir, text):
    return Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).encode(text, add_special_tokens=False).ids


def tokens_of(path):
    return np.concatenate(open_token_dataset(str(path)).shards).tolist()


def test_documents_in_input_order_each_ended_by_eos(tmp_path, tokenizer_dir):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "c.txt").write_text("first document\n")
    (tmp_path / "d" / "b.txt").write_text("def b():\n    return 'ü'\n")
    (tmp_path / "d" / "sub" / "a.txt").write_text("third")
    (tmp_path / "d" / ".hidden").write_text("skipped")
    (tmp_path / "e.jsonl").write_text('{"text": "from json", "id": 1}\n\n{"text": "last one"}\n')
    inputs = [str(tmp_path / "c.txt"), str(tmp_path / "d"), str(tmp_path / "e.jsonl")]
    ds = prepare_dataset(PrepareConfig(tokenizer=tokenizer_dir, out=str(tmp_path / "out"), inputs=inputs, workers=1))
    docs = ["first document\n", "def b():\n    return 'ü'\n", "third", "from json", "last one"]
    expected = [t for doc in docs for t in encode(tokenizer_dir, doc) + [1]]
    assert tokens_of(tmp_path / "out") == expected
    assert (ds.documents, ds.total_tokens, ds.dtype, ds.eos_id, ds.eos_token, ds.vocab_size) == (5, len(expected), "uint16", 1, "</s>", 320)
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), "rb") as f:
        assert ds.tokenizer_sha256 == hashlib.sha256(f.read()).hexdigest()
    # What transformers reads back is the text, documents joined by the EOS token.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert hf.decode(expected) == "</s>".join(docs) + "</s>"


def test_jsonl_text_key_and_shards_through_the_cli(tmp_path, tokenizer_dir):
    lines = [json.dumps({"body": f"document number {i}", "text": "not this"}) for i in range(40)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = cli("--tokenizer", tokenizer_dir, "--out", tmp_path / "out", "--text-key", "body", "--shard-tokens", 64,
                 "--workers", 2, tmp_path / "in.jsonl")
    assert result.returncode == 0, result.stderr
    ds = open_token_dataset(str(tmp_path / "out"))
    assert ds.documents == 40 and all(len(s) == 64 for s in ds.shards[:-1]) and 0 < len(ds.shards[-1]) <= 64
    assert result.stdout.strip() == f"{tmp_path / 'out'}: 40 documents, {ds.total_tokens} tokens in {len(ds.shards)} shards (uint16)"
    expected = [t for i in range(40) for t in encode(tokenizer_dir, f"document number {i}") + [1]]
    assert tokens_of(tmp_path / "out") == expected


WORDS = "the of peers train model shard round loss tensor gradient momentum over internet with no central server".split()


@pytest.mark.timeout(180)
def test_worker_count_does_not_change_the_output(tmp_path, tokenizer_dir, monkeypatch):
    rng = np.random.default_rng(0)
    (tmp_path / "in").mkdir()
    for i in range(6):  # 6 x ~400 kB: several work units
        words = rng.choice(WORDS, 70_000)
        (tmp_path / "in" / f"{i}.txt").write_text(" ".join(words) + "\n")
    # One long document, cut into pieces at newlines (at 64 kB here instead of 16 MB).
    monkeypatch.setattr(prepare, "PIECE_BYTES", 1 << 16)
    (tmp_path / "long.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(20_000)))
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        prepare_dataset(PrepareConfig(tokenizer=tokenizer_dir, out=str(out), inputs=[str(tmp_path / "in"), str(tmp_path / "long.txt")],
                                      workers=workers, shard_tokens=300_000, progress=False))
        outs.append(out)
    names = sorted(os.listdir(outs[0]))
    assert names == sorted(os.listdir(outs[1])) and len(names) > 3
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    ds = open_token_dataset(str(outs[0]))
    tokens = np.concatenate(ds.shards)
    assert ds.documents == 7 and np.count_nonzero(tokens == 1) == 7 and tokens[-1] == 1


def test_vocabulary_past_uint16_gets_uint32_shards(tmp_path):
    tokenizer_dir = build_tokenizer(str(tmp_path / "big"), vocab_size=70_000)
    (tmp_path / "a.txt").write_text("x <extra_69000> y <extra_5>")
    ds = prepare_dataset(PrepareConfig(tokenizer=tokenizer_dir, out=str(tmp_path / "out"), inputs=[str(tmp_path / "a.txt")], workers=1))
    assert ds.dtype == "uint32" and ds.vocab_size == 70_000
    tokens = tokens_of(tmp_path / "out")
    assert tokens == encode(tokenizer_dir, "x <extra_69000> y <extra_5>") + [1] and max(tokens) > 65535


def test_eos_from_config_files(tmp_path, tokenizer_dir):
    def variant(name, tokenizer_config, **files):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "tokenizer.json").write_bytes(open(os.path.join(tokenizer_dir, "tokenizer.json"), "rb").read())
        if tokenizer_config is not None:
            (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        for file, content in files.items():
            (directory / f"{file}.json").write_text(json.dumps(content))
        return str(directory)

    info = prepare.load_tokenizer_info(variant("dict", {"eos_token": {"content": "<pad>", "special": True}}))
    assert (info.eos_id, info.eos_token) == (3, "<pad>")
    info = prepare.load_tokenizer_info(variant("config", {"bos_token": "<s>"}, config={"eos_token_id": [2, 1]}))
    assert (info.eos_id, info.eos_token) == (2, "<unk>")
    info = prepare.load_tokenizer_info(variant("generation", None, generation_config={"eos_token_id": 1}))
    assert (info.eos_id, info.eos_token) == (1, "</s>")
    path = variant("none", {"bos_token": "<s>"})
    with pytest.raises(InputError, match=rf"^--tokenizer {path}: no end-of-sequence token"):
        prepare.load_tokenizer_info(path)
    path = variant("unknown", {"eos_token": "<|end|>"})
    with pytest.raises(InputError, match=r"tokenizer_config.json: eos_token '<\|end\|>' is not in the vocabulary"):
        prepare.load_tokenizer_info(path)


def leftovers(directory):
    return [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_a_failure_leaves_no_dataset_behind(tmp_path, tokenizer_dir):
    # The bad line is in the last work unit: earlier units are tokenized and written first.
    (tmp_path / "a.txt").write_text("good text " * 300_000)
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"b\.jsonl:2: not a JSON object$"):
        prepare_dataset(PrepareConfig(tokenizer=tokenizer_dir, out=str(out), inputs=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], workers=2))
    assert not out.exists() and leftovers(tmp_path) == []
    out.mkdir()  # an empty directory is fine: it is replaced
    prepare_dataset(PrepareConfig(tokenizer=tokenizer_dir, out=str(out), inputs=[str(tmp_path / "a.txt")], workers=1))
    assert os.path.isfile(out / MANIFEST) and leftovers(tmp_path) == []


def bad_cases(tmp_path, tokenizer_dir):
    good = tmp_path / "good.txt"
    good.write_text("hello")
    (tmp_path / "no-json").mkdir()
    (tmp_path / "lines.jsonl").write_text('{"text": "a"}\n\n"just a string"\n')
    (tmp_path / "keys.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    no_eos = tmp_path / "no-eos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_bytes(open(os.path.join(tokenizer_dir, "tokenizer.json"), "rb").read())
    tok, out = ["--tokenizer", tokenizer_dir], ["--out", tmp_path / "out"]
    return [
        (["--tokenizer", tmp_path / "missing", *out, good], f"--tokenizer {tmp_path / 'missing'}: no such directory"),
        (["--tokenizer", tmp_path / "no-json", *out, good], f"--tokenizer {tmp_path / 'no-json'}: no tokenizer.json"),
        (["--tokenizer", no_eos, *out, good], f"--tokenizer {no_eos}: no end-of-sequence token"),
        ([*tok, *out, tmp_path / "absent.txt"], f"{tmp_path / 'absent.txt'}: no such file or directory"),
        ([*tok, *out, tmp_path / "lines.jsonl"], f"{tmp_path / 'lines.jsonl'}:3: not a JSON object"),
        ([*tok, *out, tmp_path / "keys.jsonl"], f"{tmp_path / 'keys.jsonl'}:2: no 'text' key (see --text-key)"),
        ([*tok, "--out", tmp_path / "full", good], f"--out {tmp_path / 'full'}: exists and is not empty"),
        ([*tok, "--out", good, good], f"--out {good}: exists and is not a directory"),
        ([*tok, *out, "--workers", "0", good], "argument --workers: expected a positive integer, got '0'"),
    ]


@pytest.mark.timeout(180)
def test_bad_input_is_one_line_naming_it(tmp_path, tokenizer_dir):
    for args, message in bad_cases(tmp_path, tokenizer_dir):
        result = cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith(f"gonka-node: error: {message}"), (args, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), (args, result.stderr)
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_help_shows_the_pipeline_defaults():
    result = subprocess.run([sys.executable, "-m", "node.cli", "prepare-data", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    defaults = PrepareConfig(tokenizer="t", out="o", inputs=["i"])
    assert f"(default: {defaults.text_key})" in text and f"(default: {defaults.shard_tokens})" in text
    assert "--text-key" in text and "--workers" in text and "at most 8" in text
