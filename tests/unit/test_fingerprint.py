"""The run fingerprint: which parts make two runs different, and what a peer may announce."""

import pytest
import torch

from p2p.peertable import parse_peer_record
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.diloco import DiLoCoWorker
from trainer.fingerprint import PART_NAMES, config_digest, parse_parts, run_fingerprint

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def parts(**changes):
    base = dict(model_config={"model_type": "llama", "hidden_size": 64}, init_hash="ab" * 16, tokenizer="bytes",
                data="cd" * 8, seq_len=64, codec="fp32", outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                rounds="agg=clip,cap=relative")
    base.update(changes)
    return run_fingerprint(**base)


def test_each_part_changes_the_digest_and_is_named():
    mine = parts()
    assert mine.digest == parts().digest and mine.difference(parts().parts) == "same parts, another digest"
    changes = {"model": dict(model_config={"model_type": "llama", "hidden_size": 32}), "init": dict(init_hash="ef" * 16),
               "tokenizer": dict(tokenizer="0123" * 16), "data": dict(data="ee" * 8), "seq_len": dict(seq_len=128),
               "codec": dict(codec="int4"), "outer": dict(outer_lr=0.5), "rounds": dict(rounds="agg=mean,cap=relative"),
               "layout": dict(layout="fsdpx2")}
    assert set(changes) == set(PART_NAMES) - {"protocol"}
    for part, change in changes.items():
        other = parts(**change)
        assert other.digest != mine.digest
        assert mine.difference(other.parts).startswith(f"different {PART_NAMES[part]} (this node "), part
    assert "no run fingerprint" in mine.difference(None)
    theirs = dict(mine.parts, protocol="1")
    assert mine.difference(theirs) == "different protocol version (this node 3, peer 1)"


def test_volatile_config_keys_do_not_count():
    config = {"model_type": "qwen2", "hidden_size": 64, "vocab_size": 320}
    assert config_digest(config) == config_digest(dict(config, transformers_version="9.9", _name_or_path="/x",
                                                       dtype="bfloat16", use_cache=False))
    assert config_digest(config) != config_digest(dict(config, vocab_size=321))


def test_announced_parts_are_validated():
    assert parse_parts({"model": "ab12"}) == {"model": "ab12"}
    for bad in (None, [], {"model": 1}, {1: "x"}, {"model": "x" * 65}, {f"k{i}": "v" for i in range(2 * len(PART_NAMES) + 1)}):
        assert parse_parts(bad) is None
    ok = {"state": "training", "round": 1, "hash": "aa", "fp": "f" * 32, "fpp": parts().parts}
    record = parse_peer_record(PEER, ok)
    assert record.fingerprint == "f" * 32 and record.fingerprint_parts == parts().parts
    for bad in ({"fp": 5}, {"fp": "x" * 65}, {"fpp": {"model": ["a"]}}, {"fpp": "text"}):
        with pytest.raises(ValueError, match="bad_heartbeat_fingerprint"):
            parse_peer_record(PEER, dict(ok, **bad))


def test_a_workers_fingerprint_follows_what_decides_theta():
    corpus = torch.frombuffer(bytearray(b"every peer trains the same thing. " * 400), dtype=torch.uint8)

    def fingerprint(seed=0, seq_len=32, codec="fp32", lr=0.7, text=corpus):
        worker = DiLoCoWorker(model=ModelConfig(), data=DataConfig(seq_len=seq_len, batch_size=2), inner=InnerConfig(),
                              outer=OuterConfig(lr=lr), corpus=text, shard_key="peer", seed=seed)
        return worker.fingerprint(codec)

    base = fingerprint()
    assert base.parts == fingerprint().parts  # another peer (shard key) does not matter
    other_text = torch.frombuffer(bytearray(b"another corpus entirely, read as bytes. " * 400), dtype=torch.uint8)
    for changed, part in ((fingerprint(seed=1), "init"), (fingerprint(seq_len=64), "seq_len"),
                          (fingerprint(codec="int4"), "codec"), (fingerprint(lr=0.5), "outer"),
                          (fingerprint(text=other_text), "data")):
        differ = {k for k in base.parts if base.parts[k] != changed.parts[k]}
        assert differ == {part}, (part, differ)
