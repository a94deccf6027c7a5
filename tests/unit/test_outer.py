"""The outer step: torch SGD semantics, the same bits on every CPU, its preview, weighted averaging, and
DiLoCo's reduction to plain training."""

import asyncio
import platform

import pytest
import torch

from trainer.averaging import InProcessGroup
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import default_corpus_paths, load_corpus
from trainer.diloco import DiLoCoWorker
from trainer.outer import OuterOptimizer
from trainer.simulator import Simulator

from tests.unit.capabilities import assert_same_everywhere, by_capability, section


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(default_corpus_paths()[:30])


def configs(outer: OuterConfig) -> dict:
    return dict(
        model=ModelConfig(source="tiny"),
        data=DataConfig(batch_size=4, seq_len=64, eval_batches=2),
        inner=InnerConfig(lr=1e-3, warmup_steps=3, total_steps=40),
        outer=outer,
    )


def test_one_worker_with_unit_outer_lr_and_no_momentum_is_plain_training(corpus):
    cfg = configs(OuterConfig(lr=1.0, momentum=0.0))
    diloco = DiLoCoWorker(**cfg, corpus=corpus, shard_key="w", seed=3)
    plain = DiLoCoWorker(**cfg, corpus=corpus, shard_key="w", seed=3)
    replay = DiLoCoWorker(**cfg, corpus=corpus, shard_key="w", seed=3)
    records = Simulator.of([diloco]).run_sync(4, 5)
    assert all(r["committed"] == [True] for r in records)
    for r in range(1, 5):  # the same batches: rounds 1-4's assigned data (trainer/data.py)
        plain.train_for(r)
        plain.inner_steps(5)
    # The same training, synchronising by hand: θ ← θ − 1.0 · (θ − θ_local).
    # In fp32 θ − (θ − x) is not always x (the subtraction rounds), so this is
    # the arithmetic DiLoCo must reproduce to the bit.
    theta = [p.detach().clone() for p in replay.model.parameters()]
    for r in range(1, 5):
        replay.train_for(r)
        replay.inner_steps(5)
        with torch.no_grad():
            for t, p in zip(theta, replay.model.parameters()):
                t.sub_(t - p)
                p.copy_(t)

    assert diloco.round == 4 and diloco.inner_step == 20
    for a, r, g in zip(diloco.model.parameters(), replay.model.parameters(), diloco.global_params):
        assert torch.equal(a, r)
        assert torch.equal(a, g)
    assert diloco.sampler.state_dict() == plain.sampler.state_dict() == replay.sampler.state_dict()
    # Against uninterrupted training only those roundings differ.
    for a, p in zip(diloco.model.parameters(), plain.model.parameters()):
        assert torch.allclose(a, p, rtol=0, atol=1e-5)


def test_three_workers_one_round_matches_hand_computation(corpus):
    outer = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
    sim = Simulator(3, **configs(outer), corpus=corpus, seed=5)
    theta0 = [g.clone() for g in sim.workers[0].global_params]
    deltas, weights = [], []
    for w in sim.workers:
        def recording(into=None, w=w, original=w.pseudo_gradient):
            d = original(into)
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


def exact_values(shape, generator: torch.Generator, exponent: int) -> torch.Tensor:
    """fp32 values of 24 random bits times 2^exponent, with zeros and signed zeros: the same bits
    on every CPU (torch's float32 randn is not)."""
    values = torch.randint(-(2**24), 2**24, shape, generator=generator).to(torch.float32) * 2.0 ** (exponent - 24)
    flat = values.view(-1)
    flat[::97], flat[1::101] = 0.0, -0.0
    return values


# Shapes whose sizes are no multiple of any vector width (a vectorized kernel's tail runs other code).
SHAPES = [(517, 389), (65_537,), (3, 5, 7), (1,)]
OUTER_CONFIGS = {"nesterov": OuterConfig(lr=0.7, momentum=0.9, nesterov=True),
                 "heavy_ball": OuterConfig(lr=0.7, momentum=0.9, nesterov=False),
                 "no_momentum": OuterConfig(lr=0.7, momentum=0.0)}


def outer_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    theta = [exact_values(s, gen, 0) for s in SHAPES]
    deltas = [[exact_values(s, gen, -6) for s in SHAPES] for _ in range(3)]
    return theta, deltas


@pytest.mark.parametrize("name", OUTER_CONFIGS)
def test_outer_optimizer_matches_torch_sgd(name):
    cfg = OUTER_CONFIGS[name]
    theta, deltas = outer_inputs()
    ours = [p.clone() for p in theta]
    ref = [p.clone().requires_grad_(True) for p in theta]
    opt = OuterOptimizer(ours, cfg)
    sgd = torch.optim.SGD(ref, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
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
        # torch's vectorized kernels fuse lr * g into the update (one rounding fewer), its scalar
        # ones do not (see test_outer_step_has_the_same_bits_under_every_cpu_capability).
        for a, b in zip(ours, ref):
            assert torch.allclose(a, b.detach(), rtol=1e-6, atol=1e-8)
        # m <- mu m + delta rounds the same either way.
        for m, p in zip(opt.momentum_buffers(), ref):
            expected = sgd.state[p]["momentum_buffer"] if cfg.momentum else torch.zeros_like(p)
            assert torch.equal(m, expected)


def test_first_step_sets_momentum_to_delta_bit_for_bit():
    delta = [torch.tensor([-0.0, 0.0, 1.5])]
    opt = OuterOptimizer([torch.zeros(3)], OuterConfig(lr=0.5, momentum=0.9))
    opt.load_state_dict(opt.state_dict())  # a fresh state stays fresh
    opt.step(delta)
    m = opt.momentum_buffers()[0]
    assert torch.equal(torch.signbit(m), torch.tensor([True, False, False])) and m is not delta[0]


@pytest.mark.parametrize("name", OUTER_CONFIGS)
def test_preview_is_the_next_step_and_changes_nothing(name):
    cfg = OUTER_CONFIGS[name]
    theta, deltas = outer_inputs(1)
    opt = OuterOptimizer([p.clone() for p in theta], cfg)
    for delta in deltas:
        before = [p.clone() for p in opt.params], [m.clone() for m in opt.momentum_buffers()], opt.steps
        preview = opt.preview(delta)
        assert all(torch.equal(a, b) for a, b in zip(opt.params, before[0]))
        assert all(torch.equal(a, b) for a, b in zip(opt.momentum_buffers(), before[1])) and opt.steps == before[2]
        assert all(p is not q for p, q in zip(preview, opt.params))
        opt.step(delta)
        assert all(torch.equal(a, b) for a, b in zip(preview, opt.params))
    with pytest.raises(ValueError):
        opt.preview([torch.zeros(2)])


OUTER_CHILD = section("outer", r"""
import hashlib
import torch
from tests.unit.test_outer import OUTER_CONFIGS, outer_inputs
from trainer.outer import OuterOptimizer

def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()

out = {}
theta, deltas = outer_inputs()
for name, cfg in OUTER_CONFIGS.items():
    opt = OuterOptimizer([p.clone() for p in theta], cfg)
    ref = [p.clone().requires_grad_(True) for p in theta]
    sgd = torch.optim.SGD(ref, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    for step, delta in enumerate(deltas):
        out[f"ours_{name}_preview_{step}"] = digest(opt.preview(delta))
        opt.step(delta)
        out[f"ours_{name}_theta_{step}"] = digest(opt.params)
        out[f"ours_{name}_momentum_{step}"] = digest(opt.momentum_buffers())
        for p, d in zip(ref, delta):
            p.grad = d.clone()
        sgd.step()
    out[f"torch_sgd_{name}"] = digest(p.detach() for p in ref)
""")


@pytest.mark.timeout(240)
def test_outer_step_has_the_same_bits_under_every_cpu_capability():
    results = by_capability(OUTER_CHILD)
    assert_same_everywhere(results, "ours_")  # not torch_sgd_*: its vectorized kernels fuse lr * g
    if platform.machine().lower() in ("x86_64", "amd64"):
        # x86's scalar kernels round every product: torch's SGD there is this step, bit for bit.
        for name in OUTER_CONFIGS:
            assert results["default"][f"torch_sgd_{name}"] == results["default"][f"ours_{name}_theta_2"], name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_outer_step_on_cuda_has_the_cpu_bits():
    theta, deltas = outer_inputs()
    for cfg in OUTER_CONFIGS.values():
        cpu = OuterOptimizer([p.clone() for p in theta], cfg)
        gpu = OuterOptimizer([p.cuda() for p in theta], cfg)
        for delta in deltas:
            preview = gpu.preview([d.cuda() for d in delta])
            cpu.step(delta)
            gpu.step(delta)  # a CPU delta is moved to the parameters' device
            for a, b, c in zip(cpu.params, gpu.params, preview):
                assert torch.equal(a, b.cpu()) and torch.equal(a, c.cpu())


def test_outer_optimizer_rejects_mismatched_delta():
    opt = OuterOptimizer([torch.zeros(3)], OuterConfig())
    with pytest.raises(ValueError):
        opt.step([torch.zeros(4)])
