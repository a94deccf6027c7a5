"""θ read from pretrained files is hashed once per set of files (trainer/inithash.py)."""

import json
import os

import pytest
import torch

from tests.hf_models import build_model_dir
from trainer import diloco
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.diloco import DiLoCoWorker

pytestmark = pytest.mark.timeout(120)


def corpus():
    """Token ids the 320-token model has (a tensor of them says its vocabulary, as a dataset does)."""
    tokens = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tokens.vocab_size = 320
    return tokens


def worker(source: str, init: str = "auto") -> DiLoCoWorker:
    return DiLoCoWorker(model=ModelConfig(source=source, init=init), data=DataConfig(batch_size=1, seq_len=16),
                        inner=InnerConfig(), outer=OuterConfig(), corpus=corpus(), shard_key="a", seed=3)


def test_init_hash_is_read_back_for_the_same_files_and_recomputed_when_one_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("GONKA_CACHE_DIR", str(tmp_path / "cache"))
    path = build_model_dir(tmp_path / "model", "llama")
    calls = []
    real = diloco.params_digest
    monkeypatch.setattr(diloco, "params_digest", lambda params: calls.append(1) or real(params))
    first = worker(f"hf:{path}")
    assert len(calls) == 1 and first.init_hash == real(first.global_params)
    second = worker(f"hf:{path}")
    assert len(calls) == 1 and second.init_hash == first.init_hash  # read back, not hashed
    # A file rewritten (its mtime moves): hashed again.
    weights = os.path.join(path, "model.safetensors")
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third = worker(f"hf:{path}")
    assert len(calls) == 2 and third.init_hash == first.init_hash
    # A random init is always hashed; a damaged cache file is ignored and written anew.
    worker(f"hf:{path}", init="random")
    assert len(calls) == 3
    cache = tmp_path / "cache" / "init-hashes.json"
    cache.write_text("{not json")
    assert worker(f"hf:{path}").init_hash == first.init_hash and len(calls) == 4
    assert len(json.loads(cache.read_text())) == 1
