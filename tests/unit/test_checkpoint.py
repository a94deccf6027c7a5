"""Checkpoints: a resumed worker is the same run, and a bad or half-written file is handled."""

import os

import pytest
import torch

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import default_corpus_paths, load_corpus
from trainer.diloco import DiLoCoWorker
from trainer.simulator import Simulator


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(default_corpus_paths()[:30])


def make_worker(corpus, *, batch_size=4):
    return DiLoCoWorker(
        model=ModelConfig(source="tiny"),
        data=DataConfig(batch_size=batch_size, seq_len=64, eval_batches=2),
        inner=InnerConfig(lr=1e-3, warmup_steps=2, total_steps=30),
        outer=OuterConfig(),
        corpus=corpus,
        shard_key="peer-a",
        seed=11,
    )


def rounds(worker, n, steps=4):
    records = Simulator.of([worker]).run_sync(n, steps)
    assert all(r["committed"] == [True] for r in records)


def test_resumed_worker_continues_the_same_run(corpus, tmp_path):
    first = make_worker(corpus)
    rounds(first, 2)
    path = save_checkpoint(str(tmp_path / "ckpt" / "nested"), first.state_dict())
    assert os.path.basename(path) == "latest.pt"

    resumed = make_worker(corpus)
    resumed.load_state_dict(load_checkpoint(str(tmp_path / "ckpt" / "nested")))
    assert resumed.params_hash() == first.params_hash() and resumed.round == 2
    rounds(resumed, 2)

    straight = make_worker(corpus)
    rounds(straight, 4)

    assert resumed.params_hash() == straight.params_hash()
    assert resumed.round == straight.round == 4 and resumed.inner_step == straight.inner_step == 16
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(resumed.outer_opt.momentum_buffers(), straight.outer_opt.momentum_buffers()):
        assert torch.equal(a, b)
    assert resumed.sampler.state_dict() == straight.sampler.state_dict()
    assert (resumed.sampler.round, resumed.sampler.step) == (4, 4)  # round 4's data, 4 steps drawn
    xa, ya = resumed.sampler.next_batch()
    xb, yb = straight.sampler.next_batch()
    assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_checkpoint_of_other_config_is_rejected(corpus, tmp_path):
    save_checkpoint(str(tmp_path), make_worker(corpus).state_dict())
    other = make_worker(corpus, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(load_checkpoint(str(tmp_path)))


def test_missing_checkpoint_is_none(tmp_path):
    assert load_checkpoint(str(tmp_path / "nothing-here")) is None


def test_corrupt_checkpoint_names_the_setting(tmp_path):
    save_checkpoint(str(tmp_path), {"round": 1, "params": [torch.ones(3)]})
    with open(tmp_path / "latest.pt", "r+b") as f:
        f.seek(10)
        f.write(b"garbage" * 20)
    with pytest.raises(ValueError, match=r"^node\.checkpoint_dir: cannot load .*latest\.pt"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "latest.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"^node\.checkpoint_dir"):
        load_checkpoint(str(tmp_path))


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    # weights_only loading: an arbitrary pickled object is not a checkpoint.
    torch.save({"x": os.getcwd, "round": 1}, tmp_path / "latest.pt")
    with pytest.raises(ValueError, match=r"^node\.checkpoint_dir"):
        load_checkpoint(str(tmp_path))


def test_leftover_temp_file_from_a_crash_is_ignored(tmp_path):
    save_checkpoint(str(tmp_path), {"round": 3, "params": [torch.arange(4.0)]})
    # A writer killed mid-save leaves only its temporary file behind.
    (tmp_path / ".latest.crashed.tmp").write_bytes(b"\x80\x02half a pickle")
    state = load_checkpoint(str(tmp_path))
    assert state["round"] == 3 and torch.equal(state["params"][0], torch.arange(4.0))
    save_checkpoint(str(tmp_path), {"round": 4, "params": [torch.zeros(1)]})
    assert load_checkpoint(str(tmp_path))["round"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".latest.crashed.tmp", "latest.pt"]


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    save_checkpoint(str(tmp_path), {"round": 1})
    with pytest.raises(Exception):
        save_checkpoint(str(tmp_path), {"round": 2, "bad": lambda: None})  # cannot be pickled
    assert load_checkpoint(str(tmp_path)) == {"round": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"]


def test_a_checkpoint_taken_during_an_overlapped_outer_step_holds_all_of_it_or_none(corpus):
    # A stop can come while the outer step runs in its thread: state_dict must not read θ
    # stepped and the round not yet counted (or half the tensors stepped).
    import threading

    worker = make_worker(corpus)
    rounds(worker, 1)
    inside, release = threading.Event(), threading.Event()
    step = worker.outer_opt.step

    def held_step(avg):
        step(avg)  # θ has moved; the round is counted after this returns
        inside.set()
        assert release.wait(30)

    worker.outer_opt.step = held_step
    delta = [torch.full_like(g, 0.01) for g in worker.global_params]
    outer = threading.Thread(target=worker.apply_outer, args=(delta,), kwargs={"reset_local": False})
    outer.start()
    assert inside.wait(30)
    taken = []
    reader = threading.Thread(target=lambda: taken.append(worker.state_dict()))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not taken  # it waits for the step to end ...
    release.set()
    outer.join(30)
    reader.join(30)
    state = taken[0]  # ... and then holds all of it
    assert state["round"] == 2 == worker.round
    assert all(torch.equal(a, b) for a, b in zip(state["global_params"], worker.global_params))
