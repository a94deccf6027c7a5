"""The part owner's aggregators: the mean's arithmetic unchanged, the robust ones equal to it when
nobody is clipped, one hostile member's influence bounded, no overflow, exact norms; and the
simulator running the same code. (Their bits under every CPU capability: test_determinism.py.)"""

import asyncio
import math

import pytest
import torch

import p2p.aggregate
from p2p import native
from p2p.aggregate import AGGREGATE, FLT_MAX, aggregate, centered_clip, clip, lower_median, max_abs, mean, norm
from p2p.codecs import get_codec
from p2p.compression import SwarmAverage, average_part, part_bounds, piece_bounds
from p2p.config import AGGREGATORS
from trainer.averaging import HostileMember, InProcessGroup, attack, weighted_average

pytestmark = pytest.mark.timeout(60)

ROBUST = ("clip", "centered_clip")
N = 4_099  # no multiple of any vector width: the kernels' tails run too
WEIGHTS = [4096.0, 7168.0, 5000.0, 6000.0, 7168.0]  # the attacker (last) at the cap, the largest


def honest(count: int, n: int = N, seed: int = 0, scale: float = 1e-3) -> list[torch.Tensor]:
    """Pseudo-gradients sharing a direction, each with its own noise (as DiLoCo members' do)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(n, generator=g)
    return [(common + torch.randn(n, generator=g)) * scale for _ in range(count)]


def exact_norm(x: torch.Tensor) -> float:
    return math.sqrt(math.fsum(v * v for v in x.double().tolist()))


def test_the_registry_is_the_configs_choice():
    assert tuple(AGGREGATE) == AGGREGATORS
    with pytest.raises(ValueError, match="unknown aggregator"):
        aggregate("median", [1.0], [torch.zeros(3)])
    with pytest.raises(ValueError, match="one weight per"):
        aggregate("mean", [1.0, 2.0], [torch.zeros(3)])


def test_mean_keeps_the_part_averages_arithmetic():
    xs = honest(3, seed=1)
    weights = [4096.0, 7168.0, 1234.0]
    total = math.fsum(weights)
    expected = torch.mul(xs[0], weights[0] / total)
    for w, x in zip(weights[1:], xs[1:]):
        expected.add_(torch.mul(x, w / total))
    assert torch.equal(mean(weights, xs), expected)
    for name in ("fp32", "int8", "fp4"):
        codec = get_codec(name)
        contributions = list(zip(weights, xs))
        assert average_part(codec, contributions) == codec.encode(expected)
        assert average_part(codec, contributions, "mean") == codec.encode(expected)


@pytest.mark.parametrize("name", ROBUST)
def test_robust_aggregators_are_the_mean_when_every_member_sends_the_same(name):
    x = honest(1, seed=2)[0]
    xs = [x.clone() for _ in WEIGHTS]
    assert torch.equal(aggregate(name, WEIGHTS, xs), mean(WEIGHTS, xs))
    assert torch.allclose(aggregate(name, WEIGHTS, xs), x, rtol=1e-6, atol=0)
    # One member: its own values, exactly.
    assert torch.equal(aggregate(name, [3.0], [x]), x)


def test_clip_uses_the_lower_median_norm():
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0 and lower_median([5.0, 1.0, 3.0]) == 3.0
    base = torch.ones(64)
    xs = [base * s for s in (1.0, 2.0, 3.0, 4.0)]  # norms 8, 16, 24, 32: τ = 16
    got = clip([1.0] * 4, xs)
    assert torch.allclose(got, base * (1 + 2 + 2 + 2) / 4, rtol=1e-6)


def attacks(h: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the hostile member sends instead of its honest ``h[0]``-like pseudo-gradient."""
    own = h[0]
    g = torch.Generator().manual_seed(9)
    signs = torch.where(torch.rand(own.numel(), generator=g) < 0.5, -1.0, 1.0)
    return {
        "1e30": torch.full_like(own, 1e30),
        "3.4e38": 3.4e38 * signs,
        "flt_max": torch.full_like(own, -FLT_MAX),
        "1e4x": own * 1e4,
        "-10x": own * -10,
        "-1e4x_mean": -1e4 * mean([1.0] * len(h), h),
        "spike": torch.zeros_like(own).index_fill_(0, torch.tensor([7]), 3.4e38),
        "zero": torch.zeros_like(own),
    }


@pytest.mark.parametrize("members", [5, 8])
@pytest.mark.parametrize("name", ROBUST)
def test_one_hostile_member_moves_the_result_a_bounded_amount(name, members):
    h = honest(members - 1, seed=3)
    weights = [float(4000 + 500 * i) for i in range(members - 1)]
    weights.append(max(weights))  # the attacker's weight, capped like everyone's
    reference = mean(weights[:-1], h)
    scale = max(exact_norm(x) for x in h)
    for kind, hostile in attacks(h).items():
        got = aggregate(name, weights, h + [hostile])
        assert bool(torch.isfinite(got).all()), kind
        moved = exact_norm(got - reference)
        assert moved <= 0.5 * scale, (kind, moved / scale)


def test_the_mean_is_not_robust():
    h = honest(4, seed=3)
    reference = mean(WEIGHTS[:-1], h)
    got = mean(WEIGHTS, h + [h[0] * 1e4])
    assert exact_norm(got - reference) > 100 * max(exact_norm(x) for x in h)


@pytest.mark.parametrize("name", ROBUST)
def test_huge_inputs_never_overflow(name):
    g = torch.Generator().manual_seed(4)
    signs = [torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0) for _ in range(5)]
    cases = {
        "all_flt_max": [FLT_MAX * s for s in signs],
        "all_same_flt_max": [torch.full((N,), FLT_MAX)] * 5,
        "majority_huge": [3.4e38 * s for s in signs[:3]] + honest(2),
        "mixed_scales": [1e30 * signs[0], -3.4e38 * signs[1], *honest(2), torch.zeros(N)],
    }
    for case, xs in cases.items():
        got = aggregate(name, WEIGHTS, xs)
        assert bool(torch.isfinite(got).all()), case
        assert got.abs().max().item() <= max(x.abs().max().item() for x in xs), case


@pytest.mark.parametrize("name", list(AGGREGATE))
def test_zero_vectors(name):
    zeros = [torch.zeros(N) for _ in WEIGHTS]
    assert torch.equal(aggregate(name, WEIGHTS, zeros).abs(), torch.zeros(N))
    h = honest(2)
    got = aggregate(name, WEIGHTS, zeros[:3] + h)  # most members send nothing
    assert bool(torch.isfinite(got).all())


def test_norm_is_exact_up_to_truncation_and_ignores_order():
    g = torch.Generator().manual_seed(5)
    for x in (torch.randn(N, generator=g) * 1e-3, torch.randn(1 << 18, generator=g),
              torch.full((N,), FLT_MAX), torch.full((3,), 1e-45), torch.tensor([-2.0])):
        got = norm(x)
        assert got <= exact_norm(x) * (1 + 1e-15) and got >= exact_norm(x) * (1 - 2**-14), x[:3]
        assert norm(x[torch.randperm(x.numel(), generator=g)]) == got
        assert norm(x.flip(0)) == got
    assert norm(torch.zeros(5)) == 0.0 and norm(torch.empty(0)) == 0.0
    assert math.isfinite(norm(torch.full((1 << 18,), FLT_MAX)))


def test_results_do_not_depend_on_the_thread_count():
    xs = honest(4, n=300_007, seed=6) + [torch.full((300_007,), 3.4e38)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([aggregate(name, WEIGHTS, xs) for name in AGGREGATE])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_inputs_are_left_alone():
    xs = honest(4) + [torch.full((N,), 3.4e38)]
    copies = [x.clone() for x in xs]
    for name in AGGREGATE:
        aggregate(name, WEIGHTS, xs)
    assert all(torch.equal(x, c) for x, c in zip(xs, copies))


def test_centered_clip_iterations_bound_each_step():
    h = honest(4, seed=7)
    xs = h + [h[0] * -10]
    steps = [centered_clip(WEIGHTS, xs, iterations=i) for i in range(4)]
    assert torch.equal(steps[0], clip(WEIGHTS, xs))
    # Each step moves the centre by at most τ, the median distance, which honest members bound.
    scale = max(exact_norm(x) for x in h)
    for a, b in zip(steps, steps[1:]):
        assert exact_norm(b - a) <= 2 * scale


@pytest.mark.parametrize("owns", [None, [True, False, True, False, True]], ids=["all_own", "two_behind_nat"])
@pytest.mark.parametrize("name", list(AGGREGATE))
def test_swarm_average_aggregates_the_swarms_pieces(name, owns):
    codec = get_codec("int8")  # blocks: pieces cut at whole blocks, as the swarm cuts them
    shapes = [(37, 29), (1_000,), (5,)]
    g = torch.Generator().manual_seed(8)
    contributions = [([torch.randn(s, generator=g) for s in shapes], w) for w in (1.0, 2.0, 3.0, 4.0, 5.0)]
    contributions[-1] = ([t * -1e4 for t in contributions[-1][0]], 5.0)
    got = SwarmAverage(name, codec, piece_elems=300, owns=owns)(contributions)
    assert [t.shape for t in got] == [torch.Size(s) for s in shapes]
    flats = [torch.cat([t.reshape(-1) for t in ts]) for ts, _ in contributions]
    expected = torch.empty_like(flats[0])
    # Cut as the group cuts: a part per member, or per owner (Group.owners: none for the others).
    parts = part_bounds(flats[0].numel(), 5 if owns is None else sum(owns))
    pieces = [p for s, e in parts for p in piece_bounds(s, e, codec, 300)]
    assert len(pieces) > 5
    for s, e in pieces:
        expected[s:e] = aggregate(name, [w for _, w in contributions], [f[s:e] for f in flats])
    assert torch.equal(torch.cat([t.reshape(-1) for t in got]), expected)
    with pytest.raises(ValueError):
        SwarmAverage("nope")


def test_in_process_group_combines_with_the_swarms_code_and_a_hostile_member_is_bounded():
    h = honest(4, n=1_000, seed=10)
    group = InProcessGroup(5, combine=SwarmAverage("centered_clip"))
    members = [group.member(i) for i in range(4)] + [HostileMember(group.member(4), "fill:3.4e38")]

    async def everyone():
        return await asyncio.gather(*(m.average([x], 1.0, 0) for m, x in zip(members, h + [h[0]])))

    results = asyncio.run(everyone())
    assert all(torch.equal(r[0], results[0][0]) for r in results)
    reference = weighted_average([([x], 1.0) for x in h])[0]
    assert exact_norm(results[0][0] - reference) <= 0.5 * max(exact_norm(x) for x in h)


def test_attack_kinds():
    t = torch.tensor([1.0, -2.0, 0.0])
    assert torch.equal(attack("fill:1e30")(t), torch.tensor([-1e30, 1e30, -1e30]))
    assert torch.equal(attack("scale:-10")(t), torch.tensor([-10.0, 20.0, -0.0]))
    for bad in ("fill", "scale:x", "shout:3", "fill:inf", "scale:nan"):
        with pytest.raises(ValueError):
            attack(bad)


def _torch_only(monkeypatch, fn):
    monkeypatch.setattr(p2p.aggregate, "USE_NATIVE", False)
    try:
        return fn()
    finally:
        monkeypatch.setattr(p2p.aggregate, "USE_NATIVE", True)


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler: the torch code is all there is")
def test_the_c_kernels_give_the_torch_codes_bits(monkeypatch):
    """max_abs, norm and every aggregator through the C kernels (p2p/nibble.c) and through the torch
    code: the same bits, on values of every magnitude fp32 has, subnormals and signed zeros included."""
    g = torch.Generator().manual_seed(11)
    tiny = torch.tensor([1e-45, -1e-45, 3e-39, -1.2e-38, 0.0, -0.0, 5e-40])
    signs = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)
    wide = signs * torch.exp2(torch.randint(-149, 128, (N,), generator=g).float()) * (1 + torch.rand(N, generator=g))
    wide = wide.clamp(-FLT_MAX, FLT_MAX)
    vectors = [*honest(3), wide, tiny.repeat(N // 7 + 1)[:N], torch.full((N,), FLT_MAX) * signs,
               torch.randn(1 << 18, generator=g), torch.zeros(N), -torch.zeros(N), torch.tensor([-2.5]),
               torch.empty(0)]
    for x in vectors:
        native_norm, native_max = norm(x), max_abs(x)
        assert _torch_only(monkeypatch, lambda: (norm(x), max_abs(x))) == (native_norm, native_max), x[:4]
    groups = [honest(5), honest(4) + [wide], honest(4) + [torch.full((N,), 3.4e38) * signs],
              [wide, -wide, wide * 0.5, tiny.repeat(N // 7 + 1)[:N], torch.zeros(N)]]
    weight_sets = [WEIGHTS, [1.0, 1.0, 1.0, 1.0, 1e-30], [1.0, 1.0, 1.0, 1.0, 1e-39], [0.0, 1.0, 2.0, 3.0, 4.0]]
    for xs in groups:
        for weights in weight_sets:
            for name in AGGREGATE:
                got = aggregate(name, weights, xs)
                want = _torch_only(monkeypatch, lambda: aggregate(name, weights, xs))
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, weights)
