"""The in-process swarm: k workers learn together and stay bit-identical, also when one drops a round."""

import asyncio
import time

import pytest

from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import default_corpus_paths, load_corpus
from trainer.simulator import Simulator


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(default_corpus_paths()[:30])


def make_sim(corpus, fail=frozenset(), overlap="off", land_after=1.0):
    return Simulator(
        4,
        model=ModelConfig(source="tiny"),
        data=DataConfig(batch_size=4, seq_len=64, eval_batches=2),
        inner=InnerConfig(lr=3e-3, warmup_steps=2, total_steps=0),
        outer=OuterConfig(lr=0.7, momentum=0.9, overlap=overlap),
        corpus=corpus,
        seed=2,
        fail=fail,
        land_after=land_after,
    )


def test_four_workers_learn_and_stay_identical(corpus):
    sim = make_sim(corpus)
    assert len({w.params_hash() for w in sim.workers}) == 1  # same seed, same θ
    initial_eval = sim.workers[0].eval_loss()
    records = sim.run_sync(3, 6)

    assert [r["round"] for r in records] == [1, 2, 3]
    for r in records:
        assert len(set(r["hashes"])) == 1 and all(r["committed"])
    assert records[-1]["mean_loss"] < records[0]["mean_loss"]
    assert records[-1]["eval_loss"] < initial_eval - 0.5
    # Every worker sampled its own shard.
    batches = [w.sampler.next_batch()[0] for w in sim.workers]
    assert len({tuple(b.flatten().tolist()) for b in batches}) == 4


def test_dropped_member_resyncs_and_all_end_identical(corpus):
    sim = make_sim(corpus, fail={(1, 1)})
    records = sim.run_sync(3, 4)

    assert records[1]["committed"] == [True, False, True, True]
    assert all(records[0]["committed"]) and all(records[2]["committed"])
    # The survivors committed round 1 without worker 1; the simulator re-synced
    # it from worker 0 (load_global_state), so it joined round 2 in step.
    assert [w.round for w in sim.workers] == [3, 3, 3, 3]
    for r in records:
        assert len(set(r["hashes"])) == 1


def test_worker_resync_by_hand(corpus):
    # Same failure, re-synced explicitly: a worker that missed a round holds the
    # old θ until it loads the global state from a peer.
    sim = make_sim(corpus, fail={(1, 0)})
    reasons = []

    async def left_behind(reason):  # worker 1 does not re-sync by itself
        reasons.append(reason)

    sim.peers[1].resync = left_behind
    records = sim.run_sync(1, 3)
    w0, w1 = sim.workers[0], sim.workers[1]
    assert records[0]["committed"] == [True, False, True, True] and reasons == ["behind"]
    assert w1.round == 0 and w1.params_hash() != w0.params_hash()
    w1.load_global_state(w0.global_state())
    assert w1.round == 1 and len({w.params_hash() for w in sim.workers}) == 1
    for a, b in zip(w1.outer_opt.momentum_buffers(), w0.outer_opt.momentum_buffers()):
        assert a.equal(b)


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_overlapped_rounds_learn_and_keep_theta_identical(corpus, overlap):
    sim = make_sim(corpus, overlap=overlap)
    initial_eval = sim.workers[0].eval_loss()
    records = sim.run_sync(4, 6)
    # Round r's average lands after round r+1's inner steps: θ lags one round until the end.
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert [w.round for w in sim.workers] == [4, 4, 4, 4]
    for r in records:
        assert len(set(r["hashes"])) == 1 and all(r["committed"])
    assert len({w.params_hash() for w in sim.workers}) == 1
    assert sim.workers[0].eval_loss() < initial_eval - 0.5
    # After the drain every local copy restarted from θ.
    assert all(w.origin is None for w in sim.workers)


def test_overlapped_dropout_resyncs_and_all_end_identical(corpus):
    sim = make_sim(corpus, fail={(2, 1)}, overlap="eager")
    records = sim.run_sync(4, 4)
    # Worker 2's average of round 2 (round index 1) fails; it learns so after round 3's steps.
    assert records[2]["committed"] == [True, True, False, True]
    sim_rounds = [w.round for w in sim.workers]
    assert len(set(sim_rounds)) == 1, sim_rounds
    assert len({w.params_hash() for w in sim.workers}) == 1


def test_eager_start_is_the_outer_step_with_this_peers_delta(corpus):
    import torch

    sim = make_sim(corpus, overlap="eager")
    w = sim.workers[0]
    w.inner_steps(3)
    delta = w.pseudo_gradient()
    # Reference: the same outer optimizer on a copy, fed this peer's delta as the average.
    ref = [g.clone() for g in w.global_params]
    from trainer.outer import OuterOptimizer
    OuterOptimizer(ref, w.outer_cfg).step([d.clone() for d in delta])
    before = w.params_hash()
    w.start_overlapped(delta)
    assert w.params_hash() == before  # θ untouched
    for o, r, p in zip(w.origin, ref, w.model.parameters()):
        assert torch.allclose(o, r, atol=1e-6) and torch.equal(p.detach(), o)
    # A second preview, with momentum now present, matches torch's Nesterov step too.
    w.apply_outer([d / 2 for d in delta], reset_local=False)
    ref = [g.clone() for g in w.global_params]
    opt = OuterOptimizer(ref, w.outer_cfg)
    opt.load_state_dict(w.outer_opt.state_dict())
    opt.step([d.clone() for d in delta])
    w.start_overlapped(delta)
    assert all(torch.allclose(o, r, atol=1e-6) for o, r in zip(w.origin, ref))


def test_eager_starts_average_to_the_committed_parameters(corpus):
    """The previews are unbiased: their mean is θ after the round's outer step, so eager
    never relearns a part of the step (as a 1/M share of Δ would make every member do)."""
    import torch

    sim = make_sim(corpus, overlap="eager")
    sim.run_sync(1, 3)  # round 1: outer step applied everywhere (momentum now present)
    for w in sim.workers:
        w.inner_steps(3)
    deltas = [w.pseudo_gradient() for w in sim.workers]
    for w, d in zip(sim.workers, deltas):
        w.start_overlapped(d)
    for w in sim.workers:
        w.apply_outer([torch.stack(ts).mean(0) for ts in zip(*deltas)], reset_local=False)
    assert len({w.params_hash() for w in sim.workers}) == 1
    for i, theta in enumerate(sim.workers[0].global_params):
        mean_start = torch.stack([w.origin[i] for w in sim.workers]).mean(0)
        assert torch.allclose(mean_start, theta, atol=1e-5)
        spread = max((w.origin[i] - theta).abs().max().item() for w in sim.workers)
        assert spread > 1e-4  # the starts differ: each is off by its own deviation


def test_an_average_that_lands_before_the_first_step_is_a_round_without_overlap(corpus):
    """The local copy moves with θ when an average lands; landing at once leaves nothing stale."""
    def final(overlap, land_after=1.0):
        sim = make_sim(corpus, overlap=overlap, land_after=land_after)
        sim.run_sync(3, 4)
        return sim.workers[0]

    off, landed, late = final("off"), final("eager", land_after=0.0), final("eager")
    assert off.round == landed.round == late.round == 3
    gap_landed = max((a - b).abs().max().item() for a, b in zip(off.global_params, landed.global_params))
    gap_late = max((a - b).abs().max().item() for a, b in zip(off.global_params, late.global_params))
    assert gap_landed < 1e-4, gap_landed  # equal up to float rounding of the move
    assert gap_late > 100 * max(gap_landed, 1e-7)  # a late average does change the outcome


def test_a_landing_average_moves_the_local_copy_by_what_theta_moved(corpus):
    import torch

    sim = make_sim(corpus, overlap="eager")
    w = sim.workers[0]
    w.inner_steps(2)
    w.start_overlapped(w.pseudo_gradient())
    w.inner_steps(2)
    before = [p.detach().clone() for p in w.model.parameters()]
    origin = [o.clone() for o in w.origin]
    progress = [o - b for o, b in zip(origin, before)]
    w.apply_outer([torch.full_like(g, 0.01) for g in w.global_params], reset_local=False)
    assert all(torch.equal(p.detach(), b) for p, b in zip(w.model.parameters(), before))  # moves at its next step
    delta = w.pseudo_gradient()  # ... or when its progress is read
    for d, pr, p, g in zip(delta, progress, w.model.parameters(), w.global_params):
        assert torch.allclose(d, pr, atol=1e-6)  # the progress is kept
        assert torch.allclose(p.detach(), g - pr, atol=1e-6)  # now measured from the new θ
    assert all(torch.equal(o, g) for o, g in zip(w.origin, w.global_params))


def launched(corpus, land_step, steps=2):
    """A worker with ``outer.land_step`` that trained ``steps`` steps and launched that round."""
    import dataclasses

    w = make_sim(corpus, overlap="eager").workers[0]
    w.outer_cfg = dataclasses.replace(w.outer_cfg, land_step=land_step)
    w.inner_steps(steps)
    w.start_overlapped(w.pseudo_gradient())
    return w


def land(w):
    """The round in flight commits (the same average every time) and the node says so."""
    import torch

    w.apply_outer([torch.full_like(g, 0.01) for g in w.global_params], reset_local=False)
    w.settle()


def test_land_step_waits_for_the_average_and_takes_it_at_that_step(corpus):
    """outer.land_step=2: the step that would be the next round's 2nd waits for the round in
    flight, so the local copy moves at exactly that step however late the average lands."""
    import threading

    import torch

    reference = launched(corpus, 0)  # lands by hand between the 1st and 2nd step
    reference.inner_steps(1)
    land(reference)
    reference.inner_steps(3)

    waiting = launched(corpus, 2)
    first = waiting.inner_step
    thread = threading.Thread(target=waiting.inner_steps, args=(4,))
    thread.start()
    deadline = time.monotonic() + 30
    while waiting.inner_step < first + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(timeout=0.5)
    assert thread.is_alive() and waiting.inner_step == first + 1  # waiting at its 2nd step
    land(waiting)
    thread.join(timeout=30)
    assert not thread.is_alive() and waiting.inner_step == first + 4
    for a, b in zip(waiting.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)


def test_land_step_holds_an_early_average_until_that_step(corpus):
    import torch

    early = launched(corpus, 3)
    land(early)  # committed before the next round's first step: still taken at its 3rd
    early.inner_steps(4)
    reference = launched(corpus, 0)
    reference.inner_steps(2)
    land(reference)
    reference.inner_steps(2)
    for a, b in zip(early.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)


def test_land_step_wait_ends_on_stop_or_when_the_round_gives_up(corpus):
    w = launched(corpus, 1, steps=1)
    answers = iter([False])  # not at the loop's own check: while waiting for the round in flight
    assert w.inner_steps(3, lambda: next(answers, True)).steps == 0  # told to stop while waiting: returns
    before = w.inner_step
    w.settle()  # the round in flight will not commit (behind, stopping): train on from the preview
    assert w.inner_steps(2).steps == 2 and w.inner_step == before + 2


def test_a_pseudo_gradient_into_error_feedbacks_vector_is_its_sum_and_the_eager_start_the_same(corpus):
    """``pseudo_gradient(into=)`` adds Δ into a vector (error feedback's residual, as a node
    does: no vector of Δ alone) with the bits of Δ plus that vector; the eager start, which then
    computes Δ again tensor by tensor, is the one Δ itself gives."""
    import torch

    pair = [make_sim(corpus, overlap="eager").workers[0] for _ in range(2)]
    for w in pair:
        w.inner_steps(3)
    delta = pair[0].pseudo_gradient()
    flat = torch.cat([d.reshape(-1) for d in delta])
    residual = torch.randn(flat.numel()) * 1e-3
    into = residual.clone()
    views = pair[1].pseudo_gradient(into=into)
    assert all(v.data_ptr() >= into.data_ptr() for v in views) and views[0].data_ptr() == into.data_ptr()
    assert torch.equal(into.view(torch.int32), (flat + residual).view(torch.int32))
    pair[0].start_overlapped(delta)
    pair[1].start_overlapped(None)
    assert pair[0].params_hash() == pair[1].params_hash()
    assert all(torch.equal(a, b) for a, b in zip(pair[0].origin, pair[1].origin))
    with pytest.raises(ValueError, match="into="):
        pair[1].pseudo_gradient(into=torch.zeros(3))
