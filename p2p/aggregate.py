"""How the owner of a part combines the members' contributions to one piece (``swarm.aggregator``),
and how much each member's weight may count (``capped_weights``).

Every member of a round applies what the owner computes, so no single member may be able to drag
it far (docs/design.md, trust model). Each aggregator is a pure function over one piece: the members'
token weights (already capped, > 0) and their decoded fp32 values, in member order; it returns
the aggregated fp32 piece.

- ``mean``: the token-weighted mean. One member sending 10⁴ times its pseudo-gradient moves it
  by a fifth of that among five.
- ``clip``: each member's piece scaled by min(1, τ/‖x_i‖), τ the *lower* median of the members'
  norms (for an even count the smaller middle one: with half the members hostile the larger
  middle norm could be theirs), then the token-weighted mean. With a majority of honest members τ
  is at most the largest honest norm, so one member moves the result by at most its weight share
  times (τ + ‖honest mean‖).
- ``centered_clip``: CenteredClip (Karimireddy, He and Jaggi, ICML 2021): from the clipped mean
  v, ``CENTERED_CLIP_ITERATIONS`` times v ← v + Σ a_i min(1, τ/‖x_i − v‖)(x_i − v), a_i the
  weight shares, τ the lower median of the members' distances to v. Each step moves v by at most
  τ, and one member's pull by at most a_i τ; honest members beyond the median distance are only
  shortened, not dropped, so without an attacker the result stays near the mean.

When no member is clipped both robust aggregators return ``mean``'s bits (the clipped mean is the
mean, and a CenteredClip step that clips nobody lands on the mean).

Bits: an auditing member recomputes a piece and compares bytes with the owner's, so the result
must not depend on the CPU, its ATEN_CPU_CAPABILITY or the thread count. Only elementwise torch
ops that round once per value (add, sub, mul by a scalar; never ``add(alpha=)``, which fuses in
the vectorized kernels only), reductions that cannot round (max, min, sums of integers held
exactly) and Python floats are used: a norm is exact up to a truncation of each value, so no
order of summation can change it (``norm``). Where the C kernels are built (``p2p/native.py``),
the largest |value|, the norm's integer sum and the weighted sum run there in one pass each, with
the same operations: the tests compare their bits with this torch code, the reference and fallback.

No overflow: sums and differences of fp32 values near 3.4e38 overflow, so a piece whose largest
|value| reaches 2^LIMIT_EXP is first scaled down by a power of two (exact for every value above
2^-98, far below any honest one) and the result scaled back and clamped to the fp32 range.
"""

from __future__ import annotations

import math
import statistics
import threading
from typing import Callable, Sequence

import torch

from p2p import native

FLT_MAX = torch.finfo(torch.float32).max
# Inputs whose largest |value| reaches 2^LIMIT_EXP are scaled below it first: then a difference of
# two values (< 2^101) or a weighted sum of them can never overflow fp32.
LIMIT_EXP = 100
# CenteredClip steps from the clipped mean (quality and cost: ``scripts/bench.py aggregate``).
CENTERED_CLIP_ITERATIONS = 3
# Smallest normal fp32: a coefficient below it would lose bits when torch casts it to fp32.
_MIN_NORMAL = 2.0**-126
# Pieces up to this many values reuse per-thread buffers (a fresh 4 MB per norm costs more in page
# faults than the arithmetic); larger inputs get buffers for the call.
_SCRATCH_MAX = 1 << 20


class _Scratch:
    """Work buffers of one thread (7 MB for pieces of 2^18 values): three for ``norm``, one for the
    products of a weighted sum, two for CenteredClip's differences and previous centre."""

    def __init__(self, n: int) -> None:
        self.capacity = n
        self.f32, self.term, self.diff, self.prev = (torch.empty(n) for _ in range(4))
        self.i32 = torch.empty(n, dtype=torch.int32)
        self.f64 = torch.empty(n, dtype=torch.float64)


_local = threading.local()


def _scratch(n: int) -> _Scratch:
    s = getattr(_local, "scratch", None)
    if s is not None and s.capacity >= n:
        return s
    s = _Scratch(n)
    if n <= _SCRATCH_MAX:
        _local.scratch = s
    return s


def lower_median(values: Sequence[float]) -> float:
    """The middle value; of the two middle ones for an even count, the smaller."""
    return sorted(values)[(len(values) - 1) // 2]


def _scale_pow2(x: torch.Tensor, exp: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x · 2^exp, exact for every result in fp32's normal range; steps of at most 2^±120 so that
    each factor is itself an fp32 number."""
    while True:
        step = max(-120, min(120, exp))
        x = torch.mul(x, 2.0**step, out=out)
        out, exp = x, exp - step
        if exp == 0:
            return x


def _scaled(x: torch.Tensor, c: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x · c for a Python float 0 <= c <= 1, as torch rounds it; a c below fp32's normal range
    (which torch would cast to a subnormal with few bits) is applied as a power of two, exactly,
    then its remaining mantissa."""
    if c >= _MIN_NORMAL or c == 0.0:
        return torch.mul(x, c, out=out)
    mantissa, exp = math.frexp(c)
    return _scale_pow2(x, exp, out).mul_(mantissa)


# The C kernels of these sums (``p2p/native.py``), where they can be built; the torch code here is
# their reference and fallback (the tests run both and compare bits). False: torch code only.
USE_NATIVE = True


def _kernels(*xs: torch.Tensor):
    """The kernels, if they are to be used and every tensor is a contiguous fp32 CPU vector."""
    if not USE_NATIVE or not all(x.is_contiguous() and x.dtype == torch.float32 and x.device.type == "cpu"
                                 for x in xs):
        return None
    return native.kernels()


def max_abs(x: torch.Tensor) -> float:
    """Largest |value| (exact: a max has no rounding); 0.0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    if (kernels := _kernels(x)) is not None:
        return kernels.absmax(x)
    lo, hi = torch.aminmax(x)
    return max(-lo.item(), hi.item())


def norm(x: torch.Tensor, largest: float | None = None) -> float:
    """‖x‖₂ of a 1-D fp32 tensor as a Python float with the same bits on every CPU.

    Each value is scaled by a power of two so that the largest |value| lies just below 2^p, and
    truncated to an integer q (|q| < 2^p, p chosen so that n q² < 2^53). Every partial sum of the
    q² is then an integer that float64 holds exactly, so their sum is exact in any order, however
    torch or BLAS splits it. Each value loses less than 2^-p of the largest (p = 17 for a piece of
    2^18 values), so the norm comes out low by a relative 2^-p or so for a dense vector.
    ``largest`` is ``max_abs(x)`` where the caller has it."""
    n = x.numel()
    largest = max_abs(x) if largest is None else largest
    if largest == 0.0:
        return 0.0
    exp = math.frexp(largest)[1]  # largest < 2^exp
    p = (53 - (n - 1).bit_length()) // 2
    if (kernels := _kernels(x)) is not None:
        return math.ldexp(math.sqrt(float(kernels.sum_sq_truncated(x, 2.0 ** (p - exp)))), exp - p)
    s = _scratch(n)
    f32, i32, f64 = s.f32[:n], s.i32[:n], s.f64[:n]
    _scale_pow2(x, p - exp, out=f32)
    i32.copy_(f32)  # float -> int truncates towards zero in every kernel, vectorized or not
    f64.copy_(i32)
    return math.ldexp(math.sqrt(torch.dot(f64, f64).item()), exp - p)


def _combine(shares: Sequence[float], xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ shares_i x_i in member order, each product rounded before it is added; a fresh tensor."""
    if all(c == 0.0 or c >= _MIN_NORMAL for c in shares) and (kernels := _kernels(*xs)) is not None:
        return kernels.weighted_sum(list(xs), list(shares), torch.empty(xs[0].numel()))
    acc = _scaled(xs[0], shares[0])
    term = _scratch(acc.numel()).term[: acc.numel()]
    for c, x in zip(shares[1:], xs[1:]):
        acc.add_(_scaled(x, c, out=term))
    return acc


def _shares(weights: Sequence[float]) -> list[float]:
    total = math.fsum(weights)
    assert total > 0 and all(w >= 0 for w in weights), "weights are capped and checked before"
    return [w / total for w in weights]


def _scale_down(xs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[float], int]:
    """The inputs scaled by 2^-k so that every |value| is below 2^LIMIT_EXP, their largest |value|s
    (scaled too), and k (0 for every real pseudo-gradient: then the inputs themselves)."""
    largest = [max_abs(x) for x in xs]
    top = max(largest)
    if top < 2.0**LIMIT_EXP:
        return list(xs), largest, 0
    k = math.frexp(top)[1] - LIMIT_EXP
    return [_scale_pow2(x, -k) for x in xs], [m * 2.0**-k for m in largest], k


def _scale_up(x: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0:
        return x
    return _scale_pow2(x, k, out=x).clamp_(-FLT_MAX, FLT_MAX)  # only a result at the fp32 limit can round past it


def mean(weights: Sequence[float], xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Token-weighted mean: Σ (w_i / Σw) x_i in member order."""
    return _combine(_shares(weights), xs)


def _clipped_shares(shares: Sequence[float], norms: Sequence[float]) -> list[float]:
    tau = lower_median(norms)
    return [a if n <= tau else a * (tau / n) for a, n in zip(shares, norms)]


def clip(weights: Sequence[float], xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each member's piece clipped to the lower median of the members' norms, then the weighted
    mean (the clip folded into each member's coefficient: one rounding per product)."""
    shares = _shares(weights)
    xs, largest, k = _scale_down(xs)
    norms = [norm(x, m) for x, m in zip(xs, largest)]
    return _scale_up(_combine(_clipped_shares(shares, norms), xs), k)


def centered_clip(weights: Sequence[float], xs: Sequence[torch.Tensor], *,
                  iterations: int = CENTERED_CLIP_ITERATIONS) -> torch.Tensor:
    """CenteredClip from the clipped mean, τ the lower median of the distances at each step."""
    shares = _shares(weights)
    xs, largest, k = _scale_down(xs)
    v = _combine(_clipped_shares(shares, [norm(x, m) for x, m in zip(xs, largest)]), xs)
    n = v.numel()
    s = _scratch(n)
    diff, prev, term = s.diff[:n], s.prev[:n], s.term[:n]
    for _ in range(iterations):
        # |x|, |v| < 2^101: no difference overflows. The differences are recomputed for the step
        # (cheaper than keeping one per member).
        dists = [norm(torch.sub(x, v, out=diff)) for x in xs]
        tau = lower_median(dists)
        if max(dists) <= tau:  # nobody clipped: this step lands on the weighted mean
            return _scale_up(_combine(shares, xs), k)
        if tau == 0.0:  # most members sit at v already: no step moves it
            break
        prev.copy_(v)
        for a, dist, x in zip(shares, dists, xs):
            if dist > 0.0:
                torch.sub(x, prev, out=diff)
                v.add_(_scaled(diff, a if dist <= tau else a * (tau / dist), out=term))
    return _scale_up(v, k)


AGGREGATE: dict[str, Callable[[Sequence[float], Sequence[torch.Tensor]], torch.Tensor]] = {
    "mean": mean,
    "clip": clip,
    "centered_clip": centered_clip,
}


# ---- how much each member counts ------------------------------------------------------------

# With no fixed cap on a member's weight (no round-token budget), a weight counts at most this
# many times the median weight of the group's members: one member among five that claims
# any number of tokens carries at most 2/6 of the weight.
RELATIVE_WEIGHT_CAP = 2.0


def capped_weights(weights: list[float], cap: float) -> list[float]:
    """Members' weights as the average counts them: at most ``cap`` (what a round allows), or,
    with ``cap`` 0, at most RELATIVE_WEIGHT_CAP times their median. One member cannot buy
    influence by claiming tokens it could not have trained on."""
    limit = cap if cap > 0 else RELATIVE_WEIGHT_CAP * statistics.median_low(weights)
    return [min(w, limit) for w in weights]


def counted_weights(weights: list[float], cap: float, factors: list[float]) -> list[float]:
    """Members' weights as the average counts them: capped (``capped_weights``), then times each
    member's standing in the ledger (p2p/ledger.py: 1, or less after a flagged round)."""
    return [w * f for w, f in zip(capped_weights(weights, cap), factors)]


def counted_tokens(others: list[int], mine: int) -> int:
    """The other peers' announced progress towards a round-token budget, as this peer counts it:
    each claim at most RELATIVE_WEIGHT_CAP times the median claim (ours included), so one peer
    announcing a huge number cannot end everybody's round at once."""
    if not others:
        return 0
    return int(sum(capped_weights([float(c) for c in others] + [float(mine)], 0.0)[:-1]))


def aggregate(name: str, weights: Sequence[float], xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The aggregator called ``name`` over one piece (fp32 tensors of one shape, worked on flat);
    ValueError naming the choices otherwise."""
    try:
        fn = AGGREGATE[name]
    except KeyError:
        raise ValueError(f"unknown aggregator {name!r} (choose from {', '.join(AGGREGATE)})") from None
    if len(weights) != len(xs) or not xs:
        raise ValueError(f"need one weight per contribution (got {len(weights)} weights, {len(xs)} pieces)")
    shape = xs[0].shape
    if any(x.dtype != torch.float32 or x.shape != shape for x in xs):
        raise ValueError("contributions must be fp32 tensors of one shape")
    return fn(weights, [x.reshape(-1) for x in xs]).view(shape)
