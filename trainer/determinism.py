"""Random initialisation whose bits do not depend on the CPU it runs on.

Every peer must build the same θ from the same seed, on x86 hosts with or
without AVX-512 and on ARM hosts alike. torch's own samplers do not promise
that: float32 ``normal_`` has an AVX2 kernel (Sleef math, fused multiply-adds)
and gives other bits under ATEN_CPU_CAPABILITY=default; float64 ``normal_`` is
one scalar loop, but it calls the C library's log, sin and cos, and glibc picks
their implementation by CPU (FMA or not; ARM has its own), so its bits changed
when glibc was told the CPU had no FMA.

What is capability-independent is the generator itself (mt19937, integer
arithmetic; ``uniform_`` on float64 is ``k * 2^-53`` for a 53-bit integer k)
and every IEEE operation with one rounding: +, -, *, /, sqrt, comparisons,
rounding to an integer, conversions. ``seeded_normal_`` builds Box-Muller from
those alone: log, sin and cos are fdlibm's polynomials, each product and sum a
separate torch op on float64 (so no kernel can fuse two roundings into one),
and the result is rounded once to the tensor's dtype. float64 carries ~1e-16
relative error through the transform, far below float32's rounding, so the
values are those of an exact Box-Muller rounded to float32 (but for ties
within ~1e-16): the same distribution, only not torch's stream.
"""

from __future__ import annotations

import math

import torch

# Values per pass: bounds the float64 temporaries (about ten of them, 8 bytes a value)
# while keeping the number of torch ops small. The values do not depend on it.
CHUNK_ELEMS = 1 << 18  # even: a chunk holds whole pairs

# Constants as literals (parsed with correct rounding everywhere), not from the host's libm.
_LN2 = 0.6931471805599453
_HALF_PI = 1.5707963267948966
_SQRT_HALF = 0.7071067811865476

# fdlibm's e_log.c: log(1+f) = 2s + s R(s^2), s = f / (2 + f), |f| <= sqrt(2) - 1.
_LOG_R = (1.479819860511658591e-01, 1.531383769920937332e-01, 1.818357216161805012e-01, 2.222219843214978396e-01,
          2.857142874366239149e-01, 3.999999999940941908e-01, 6.666666666666735130e-01)  # Lg7 .. Lg1
# fdlibm's k_sin.c / k_cos.c on [-pi/4, pi/4]: sin x = x + x^3 S(x^2), cos x = 1 - x^2/2 + x^4 C(x^2).
_SIN = (1.58969099521155010221e-10, -2.50507602534068634195e-08, 2.75573137070700676789e-06,
        -1.98412698298579493134e-04, 8.33333333332248946124e-03, -1.66666666666666324348e-01)  # S6 .. S1
_COS = (-1.13596475577881948265e-11, 2.08757232129817482790e-09, -2.75573143513906633035e-07,
        2.48015872894767294178e-05, -1.38888888888741095749e-03, 4.16666666666666019037e-02)  # C6 .. C1


def _horner(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """c0 x^(n-1) + ... + c(n-1), one multiply and one add per step, each rounded."""
    acc = torch.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        acc.mul_(x).add_(c)
    return acc


def _minus_two_log(u: torch.Tensor) -> torch.Tensor:
    """-2 ln u for u in (0, 1] (float64): u = m 2^e with m in [sqrt(1/2), sqrt(2))."""
    m, e = torch.frexp(u)  # m in [1/2, 1)
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2, m)
    f = m.sub_(1)  # exact (Sterbenz)
    s = f / torch.add(f, 2)
    z = s * s
    log_m = _horner(z, _LOG_R).mul_(z).mul_(s).add_(torch.mul(s, 2))  # 2s + s R(z), R(z) = z (Lg1 + ... + Lg7 z^6)
    log_u = e.sub_(low.to(e.dtype)).to(torch.float64).mul_(_LN2).add_(log_m)
    return log_u.mul_(-2)


def _sin_cos_two_pi(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sin(2 pi u) and cos(2 pi u) for u in [0, 1) (float64), reduced to the nearest quarter turn."""
    t = u * 4  # exact
    quarter = torch.round(t)
    x = t.sub_(quarter).mul_(_HALF_PI)  # t - quarter is exact; |x| <= pi/4
    z = x * x
    sin = _horner(z, _SIN).mul_(z).mul_(x).add_(x)
    cos = _horner(z, _COS).mul_(z).mul_(z).sub_(torch.mul(z, 0.5)).add_(1)
    q = quarter.to(torch.int32)
    odd = (q & 1).bool()
    sin, cos = torch.where(odd, cos, sin), torch.where(odd, sin, cos)
    sin = torch.where((q & 2).bool(), sin.neg(), sin)  # quarters 2, 3 (4 is 0)
    cos = torch.where(((q + 1) & 2).bool(), cos.neg(), cos)  # quarters 1, 2
    return sin, cos


def _standard_normal_pairs(uniform: torch.Tensor) -> torch.Tensor:
    """Box-Muller on float64 uniforms in [0, 1): values 2i and 2i+1 from uniforms 2i and 2i+1."""
    pairs = uniform.view(-1, 2)
    radius = _minus_two_log(torch.rsub(pairs[:, 0], 1)).sqrt_()  # 1 - u in (0, 1], exact
    sin, cos = _sin_cos_two_pi(pairs[:, 1].contiguous())
    out = torch.empty_like(pairs)
    torch.mul(radius, cos, out=out[:, 0])
    torch.mul(radius, sin, out=out[:, 1])
    return out.view(-1)


@torch.no_grad()
def seeded_normal_(tensor: torch.Tensor, std: float, generator: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    """Fill ``tensor`` (any float dtype) with N(mean, std^2) draws from ``generator``, in place.

    The bits depend only on the generator's state, the number of values, mean and std:
    not on the CPU, ATEN_CPU_CAPABILITY, the thread count or CHUNK_ELEMS. Takes
    2 * ceil(n / 2) draws (float64 ``uniform_``) from ``generator``; returns ``tensor``."""
    if not tensor.is_floating_point():
        raise ValueError(f"seeded_normal_ fills a floating-point tensor, got {tensor.dtype}")
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise ValueError("seeded_normal_ needs a CPU torch.Generator")
    if not (math.isfinite(std) and std >= 0 and math.isfinite(mean)):
        raise ValueError(f"seeded_normal_ needs a finite std >= 0 and a finite mean (got std={std}, mean={mean})")
    contiguous = tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    n = flat.numel()
    uniform = torch.empty(min(CHUNK_ELEMS, n + n % 2), dtype=torch.float64)
    for start in range(0, n, CHUNK_ELEMS):
        end = min(start + CHUNK_ELEMS, n)
        count = end - start + (end - start) % 2  # an odd tail still draws a whole pair
        values = _standard_normal_pairs(uniform[:count].uniform_(generator=generator))[: end - start]
        values = values.mul_(std).add_(mean)
        if tensor.dtype != torch.float64:
            # Through float32 first, so each dtype has one well-defined rounding chain.
            values = values.to(torch.float32)
        flat[start:end].copy_(values)
    if not contiguous:
        tensor.copy_(flat.view_as(tensor))
    return tensor
