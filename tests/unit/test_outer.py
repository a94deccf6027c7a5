"""The outer step: torch SGD semantics, weighted averaging, and DiLoCo's reduction to plain training."""

import asyncio

import pytest
import torch

from trainer.averaging import InProcessGroup
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import default_corpus_paths, load_corpus
from trainer.diloco import DiLoCoWorker, run_round
from trainer.outer import OuterOptimizer
from trainer.simulator import Simulator


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(default_corpus_paths()[:30])


def configs(outer: OuterConfig) -> dict:
    return dict(
        model=ModelConfig(preset="tiny"),
        data=DataConfig(batch_size=4, seq_len=64, eval_batches=2),
        inner=InnerConfig(lr=1e-3, warmup_steps=3, total_steps=40),
        outer=outer,
    )


def test_one_worker_with_unit_outer_lr_and_no_momentum_is_plain_training(corpus):
    cfg = configs(OuterConfig(lr=1.0, momentum=0.0))
    diloco = DiLoCoWorker(**cfg, corpus=corpus, shard_key="w", seed=3)
    plain = DiLoCoWorker(**cfg, corpus=corpus, shard_key="w", seed=3)
    replay = DiLoCoWorker(**cfg, corpus=corpus, shard_key="w", seed=3)
    member = InProcessGroup(1).member(0)

    async def rounds():
        for _ in range(4):
            _, ok = await run_round(diloco, member, 5)
            assert ok

    asyncio.run(rounds())
    plain.inner_steps(20)
    # The same training, synchronising by hand: θ ← θ − 1.0 · (θ − θ_local).
    # In fp32 θ − (θ − x) is not always x (the subtraction rounds), so this is
    # the arithmetic DiLoCo must reproduce to the bit.
    theta = [p.detach().clone() for p in replay.model.parameters()]
    for _ in range(4):
        replay.inner_steps(5)
        with torch.no_grad():
            for t, p in zip(theta, replay.model.parameters()):
                t.sub_(t - p)
                p.copy_(t)

    assert diloco.round == 4 and diloco.inner_step == 20
    for a, r, g in zip(diloco.model.parameters(), replay.model.parameters(), diloco.global_params):
        assert torch.equal(a, r)
        assert torch.equal(a, g)
    assert diloco.sampler.state_dict()["batches_drawn"] == plain.sampler.state_dict()["batches_drawn"]
    # Against uninterrupted training only those roundings differ.
    for a, p in zip(diloco.model.parameters(), plain.model.parameters()):
        assert torch.allclose(a, p, rtol=0, atol=1e-5)


def test_three_workers_one_round_matches_hand_computation(corpus):
    outer = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
    sim = Simulator(3, **configs(outer), corpus=corpus, seed=5)
    theta0 = [g.clone() for g in sim.workers[0].global_params]
    deltas, weights = [], []
    for w in sim.workers:
        def recording(w=w, original=w.pseudo_gradient):
            d = original()
            deltas.append([t.clone() for t in d])
            weights.append(float(w.inner_step * 4 * 64))
            return d
        w.pseudo_gradient = recording

    records = sim.run_sync(1, 4)

    assert len(deltas) == 3 and records[0]["committed"] == [True, True, True]
    assert not torch.equal(deltas[0][0], deltas[1][0])  # different shards
    total = sum(weights)
    for i, theta in enumerate(theta0):
        avg = sum(wt * d[i].double() for wt, d in zip(weights, deltas)) / total
        m = avg  # torch's first momentum step: m = Δ
        expected = (theta.double() - outer.lr * (avg + outer.momentum * m)).float()
        assert torch.allclose(sim.workers[0].global_params[i], expected, rtol=1e-6, atol=1e-8)
    assert len(set(records[0]["hashes"])) == 1
    assert records[0]["hashes"] == [w.params_hash() for w in sim.workers]
    assert all(w.round == 1 for w in sim.workers)


def test_group_average_is_token_weighted_and_identical_for_members():
    group = InProcessGroup(3)
    parts = [([torch.full((2, 2), v), torch.tensor([v])], w) for v, w in ((1.0, 1.0), (2.0, 2.0), (4.0, 5.0))]

    async def everyone():
        return await asyncio.gather(*(group.member(i).average(t, weight=w, round=0) for i, (t, w) in enumerate(parts)))

    results = asyncio.run(everyone())
    expected = (1 * 1 + 2 * 2 + 4 * 5) / 8
    for res in results:
        assert torch.equal(res[0], torch.full((2, 2), expected)) and torch.equal(res[1], torch.tensor([expected]))
    assert results[0][0] is not results[1][0]


def test_failed_member_gets_none_and_the_rest_average_without_it():
    group = InProcessGroup(3, fail={(1, 0)})

    async def everyone():
        return await asyncio.gather(*(group.member(i).average([torch.tensor([float(i)])], weight=1.0, round=0) for i in range(3)))

    a, b, c = asyncio.run(everyone())
    assert b is None
    assert torch.equal(a[0], torch.tensor([1.0])) and torch.equal(c[0], torch.tensor([1.0]))


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_optimizer_matches_torch_sgd_bit_for_bit(nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    ours = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone().requires_grad_(True) for p in ours]
    deltas = [[torch.randn(s, generator=gen) * 0.01 for s in shapes] for _ in range(3)]
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    opt = OuterOptimizer(ours, cfg)
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=nesterov)
    assert all(torch.equal(m, torch.zeros_like(p)) for m, p in zip(opt.momentum_buffers(), ours))
    for step, delta in enumerate(deltas):
        if step == 2:
            # A resumed optimizer continues the same sequence.
            saved = opt.state_dict()
            ours = [p.clone() for p in ours]
            opt = OuterOptimizer(ours, cfg)
            opt.load_state_dict(saved)
        for p, d in zip(ref, delta):
            p.grad = d.clone()
        sgd.step()
        opt.step(delta)
        for a, b in zip(ours, ref):
            assert torch.equal(a, b.detach())
        for m, p in zip(opt.momentum_buffers(), ref):
            assert torch.equal(m, sgd.state[p]["momentum_buffer"])


def test_outer_optimizer_rejects_mismatched_delta():
    opt = OuterOptimizer([torch.zeros(3)], OuterConfig())
    with pytest.raises(ValueError):
        opt.step([torch.zeros(4)])
