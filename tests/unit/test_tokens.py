"""The token-shard format: writing, opening, and every way a dataset on disk can be wrong."""

import hashlib
import json
import mmap
import os

import numpy as np
import pytest

from trainer.tokens import (
    HEADER_BYTES,
    MAGIC,
    MANIFEST,
    ShardWriter,
    dtype_for_vocab,
    file_sha256,
    is_token_dataset,
    open_token_dataset,
    pack_header,
    shard_name,
)


def tokenizer(vocab_size=1000):
    return {"sha256": "ab" * 32, "vocab_size": vocab_size, "eos_id": 2, "eos_token": "</s>", "source": "/models/x"}


def write(directory, tokens, *, dtype="uint16", shard_tokens=100, documents=3, vocab_size=1000):
    os.makedirs(directory, exist_ok=True)
    writer = ShardWriter(str(directory), dtype=dtype, shard_tokens=shard_tokens)
    for piece in np.array_split(np.asarray(tokens, dtype=dtype), 4):  # several add() calls
        writer.add(piece)
    writer.finish(tokenizer=tokenizer(vocab_size), documents=documents)
    return str(directory)


def test_round_trip_across_shards(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, 250).astype(np.uint16)
    path = write(tmp_path, tokens)
    assert is_token_dataset(path) and not is_token_dataset(str(tmp_path / "nope"))
    ds = open_token_dataset(path)
    assert [len(s) for s in ds.shards] == [100, 100, 50]
    assert np.array_equal(np.concatenate(ds.shards), tokens)
    assert ds.total_tokens == 250 and ds.documents == 3 and ds.dtype == "uint16"
    assert (ds.vocab_size, ds.eos_id, ds.eos_token, ds.tokenizer_sha256) == (1000, 2, "</s>", "ab" * 32)
    assert ds.path == path and ds.shard_paths == [os.path.join(path, shard_name(i)) for i in range(3)]
    with open(os.path.join(path, MANIFEST), "rb") as f:
        raw = f.read()
    assert ds.manifest_sha256 == hashlib.sha256(raw).hexdigest()
    manifest = json.loads(raw)
    assert manifest["format"] == "gonka-tokens" and manifest["version"] == 1
    for shard, file in zip(manifest["shards"], ds.shard_paths):
        with open(file, "rb") as f:
            data = f.read()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest() == file_sha256(file)
        assert data[:8] == MAGIC and len(data) == HEADER_BYTES + 2 * shard["tokens"]
    # The shards are memory maps over the files, not copies.
    assert all(isinstance(s.base.obj, mmap.mmap) for s in ds.shards)
    assert not ds.shards[0].flags.writeable


def test_uint16_until_the_vocabulary_needs_more(tmp_path):
    assert dtype_for_vocab(256) == dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == dtype_for_vocab(200_000) == "uint32"
    tokens = np.array([0, 65535, 65536, 199_999, 7], dtype=np.uint32)
    ds = open_token_dataset(write(tmp_path, tokens, dtype="uint32", vocab_size=200_000))
    assert ds.dtype == "uint32" and ds.shards[0].dtype.itemsize == 4
    assert np.array_equal(ds.shards[0], tokens)
    assert os.path.getsize(ds.shard_paths[0]) == HEADER_BYTES + 4 * len(tokens)


def dataset(tmp_path):
    return write(tmp_path / "ds", np.arange(250) % 1000)


def edit_manifest(path, change):
    file = os.path.join(path, MANIFEST)
    with open(file) as f:
        manifest = json.load(f)
    change(manifest)
    with open(file, "w") as f:
        json.dump(manifest, f)


def rewrite(file, offset, data):
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def assert_reported(path, file, what, verify=True):
    with pytest.raises(ValueError) as info:
        open_token_dataset(path, verify=verify)
    message = str(info.value)
    assert message.startswith(f"data.paths: {file}: ") and "\n" not in message, message
    assert what in message, message


def test_missing_or_invalid_manifest(tmp_path):
    assert_reported(str(tmp_path / "none"), tmp_path / "none", "no such dataset directory")
    (tmp_path / "empty").mkdir()
    assert_reported(str(tmp_path / "empty"), tmp_path / "empty" / MANIFEST, "missing; not a token dataset")
    path = dataset(tmp_path)
    manifest = os.path.join(path, MANIFEST)
    with open(manifest, "w") as f:
        f.write("{not json")
    assert_reported(path, manifest, "not valid JSON")
    cases = [
        (lambda m: m.update(format="other"), "not a gonka-tokens manifest"),
        (lambda m: m.update(version=2), "unknown format version 2"),
        (lambda m: m.update(dtype="float32"), "unknown dtype 'float32'"),
        (lambda m: m["tokenizer"].update(vocab_size=70000), "uint16 cannot hold a vocabulary of 70000"),
        (lambda m: m["tokenizer"].pop("eos_id"), "'eos_id' missing"),
        (lambda m: m.update(total_tokens=251), "total_tokens is 251 but the shards hold 250"),
        (lambda m: m.update(shards=[]), "'shards' missing or empty"),
        (lambda m: m["shards"][0].update(file="../elsewhere.bin"), "not a plain file name"),
        (lambda m: m["shards"][1].update(tokens=-1), "'tokens' missing or not a non-negative integer"),
    ]
    for change, what in cases:
        path = dataset(tmp_path / what.replace(" ", "_").replace("/", "_"))
        edit_manifest(path, change)
        assert_reported(path, os.path.join(path, MANIFEST), what)


def test_broken_shards(tmp_path):
    def case(name):
        path = dataset(tmp_path / name)
        return path, os.path.join(path, shard_name(1))

    path, shard = case("missing")
    os.remove(shard)
    assert_reported(path, shard, "shard missing")
    path, shard = case("magic")
    rewrite(shard, 0, b"NOTTOKEN")
    assert_reported(path, shard, "not a token shard (magic b'NOTTOKEN'")
    path, shard = case("version")
    rewrite(shard, 8, (9).to_bytes(4, "little"))
    assert_reported(path, shard, "unknown shard format version 9")
    path, shard = case("dtype")
    rewrite(shard, 12, (7).to_bytes(4, "little"))
    assert_reported(path, shard, "unknown dtype code 7")
    path, shard = case("other-dtype")
    rewrite(shard, 0, pack_header("uint32", 100))
    assert_reported(path, shard, "shard holds uint32 tokens, the manifest says uint16")
    path, shard = case("count")
    rewrite(shard, 0, pack_header("uint16", 99))
    assert_reported(path, shard, "header counts 99 tokens, the manifest 100")
    path, shard = case("truncated")
    os.truncate(shard, HEADER_BYTES + 150)
    assert_reported(path, shard, f"truncated shard: {HEADER_BYTES + 150} bytes, 100 tokens need {HEADER_BYTES + 200}")
    os.truncate(shard, 10)
    assert_reported(path, shard, "truncated shard: 10 bytes, shorter than its header")
    path, shard = case("longer")
    with open(shard, "ab") as f:
        f.write(b"\0\0")
    assert_reported(path, shard, "2 bytes after its 100 tokens")
    path, shard = case("corrupt")
    rewrite(shard, HEADER_BYTES + 10, b"\xff")
    assert_reported(path, shard, "sha256 is ")
    # Without verify only the structure is checked: the flipped byte goes unnoticed.
    assert open_token_dataset(path, verify=False).shards[1][5] != 105
