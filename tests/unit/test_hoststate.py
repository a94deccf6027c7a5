"""θ and the outer momentum in memory-mapped files (``outer.state_dir``, trainer/hoststate.py): the
same run bit for bit as in RAM, the files hold the state, checkpoints resume it, one node a
directory."""

import dataclasses
import os

import numpy as np
import pytest
import torch

from p2p.snapshot import Snapshot
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import default_corpus_paths, load_corpus
from trainer.diloco import DiLoCoWorker
from trainer.hoststate import MappedState, StateDirInUse
from trainer.simulator import Simulator

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(default_corpus_paths()[:4])


def worker(corpus, state_dir: str = "", shard_key: str = "peer-a") -> DiLoCoWorker:
    return DiLoCoWorker(model=ModelConfig(source="tiny"), data=DataConfig(batch_size=2, seq_len=32, eval_batches=1),
                        inner=InnerConfig(lr=1e-3, warmup_steps=1, total_steps=20),
                        outer=OuterConfig(state_dir=state_dir), corpus=corpus, shard_key=shard_key, seed=5)


def test_a_run_with_its_outer_state_on_disk_is_the_run_in_ram_bit_for_bit(corpus, tmp_path):
    in_ram = [worker(corpus, shard_key=k) for k in ("a", "b")]
    on_disk = [worker(corpus, str(tmp_path / k), shard_key=k) for k in ("a", "b")]
    for workers in (in_ram, on_disk):
        assert all(r["committed"] == [True, True] for r in Simulator.of(workers).run_sync(3, 2))
    for ram, disk in zip(in_ram, on_disk):
        assert disk.round == ram.round == 3 and disk.params_hash() == ram.params_hash()
        assert all(torch.equal(a, b) for a, b in zip(disk.outer_opt.momentum_buffers(),
                                                     ram.outer_opt.momentum_buffers()))
    # The state is the files': θ and the momentum read back from disk are the worker's.
    disk = on_disk[0]
    for name, tensors in (("theta", disk.global_params), ("momentum", disk.outer_opt.momentum_buffers())):
        stored = np.fromfile(tmp_path / "a" / f"{name}.f32", dtype=np.float32)
        assert np.array_equal(stored, torch.cat([t.reshape(-1) for t in tensors]).numpy())
    # A checkpoint of it resumes into another directory (or into RAM) as the same state. Its copy
    # of θ and the momentum is in (unlinked) mapped files, not in RAM, and leaves no file behind.
    save_checkpoint(str(tmp_path / "ckpt"), disk.state_dict())
    copied = disk.state_dict()
    assert all(t.untyped_storage().filename for t in [*copied["global_params"], *copied["outer"]["momentum"]])
    assert sorted(os.listdir(tmp_path / "a")) == ["lock", "momentum.f32", "theta.f32"]
    state = load_checkpoint(str(tmp_path / "ckpt"))
    for target in (worker(corpus, str(tmp_path / "resumed"), shard_key="a"), worker(corpus, shard_key="a")):
        target.load_state_dict(state)
        assert target.params_hash() == disk.params_hash() and target.round == 3
        assert all(torch.equal(a, b) for a, b in zip(target.outer_opt.momentum_buffers(),
                                                     disk.outer_opt.momentum_buffers()))


def test_a_directory_is_one_nodes_and_a_bad_one_is_named(tmp_path):
    first = MappedState(str(tmp_path / "s"))
    # A joiner's snapshot (served, or downloaded) in an unlinked file there, not in RAM.
    params, momentum = [torch.randn(3, 5)], [torch.randn(3, 5)]
    asked = []
    snap = Snapshot.build(2, "h", params, momentum, 1 << 16, scratch=lambda n: asked.append(n) or first.scratch(n))
    assert asked == [30] and len(snap.blob) == 120
    state = snap.unpack()
    assert torch.equal(state["params"][0], params[0]) and torch.equal(state["momentum"][0], momentum[0])
    assert os.listdir(tmp_path / "s") == ["lock"]
    with pytest.raises(StateDirInUse, match="outer.state_dir"):
        MappedState(str(tmp_path / "s"))
    vector = first.vector("theta", 1000)
    assert os.path.getsize(tmp_path / "s" / "theta.f32") == 4000 and vector.eq(0).all()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="outer.state_dir: cannot use"):
        MappedState(str(tmp_path / "file" / "below"))
    assert dataclasses.replace(OuterConfig(), state_dir="x").state_dir == "x"


def test_error_feedback_keeps_its_residual_in_the_mapped_files(tmp_path):
    from p2p.codecs import get_codec
    from p2p.feedback import ErrorFeedback

    state = MappedState(str(tmp_path / "s"))
    codec, x = get_codec("int8"), torch.randn(4096, generator=torch.Generator().manual_seed(1))
    on_disk, in_ram = ErrorFeedback(4096, state.scratch), ErrorFeedback(4096)
    assert on_disk.residual.untyped_storage().filename and on_disk.residual.eq(0).all()
    assert on_disk.encode(codec, x) == in_ram.encode(codec, x)  # the same residual, bit for bit
    saved = on_disk.state_dict()
    assert saved["residual"].untyped_storage().filename and torch.equal(saved["residual"], in_ram.residual)
    restored = ErrorFeedback(4096, state.scratch)
    restored.load_state_dict(saved)
    assert restored.residual.untyped_storage().filename and torch.equal(restored.residual, in_ram.residual)
    assert os.listdir(tmp_path / "s") == ["lock"]

