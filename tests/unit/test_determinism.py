"""Bits that must not depend on the CPU: seeded_normal_, the part owner's average and its robust
aggregators (norms included), compared across child processes run under each ATEN_CPU_CAPABILITY
this CPU has (tests/unit/capabilities.py); and seeded_normal_'s distribution, stream and arguments
in-process."""

import math

import pytest
import torch

from tests.unit.capabilities import assert_same_everywhere, by_capability, section
from trainer import determinism
from trainer.determinism import seeded_normal_

pytestmark = pytest.mark.timeout(240)

CHILD = section("determinism", r"""
import hashlib
import torch
from p2p.blockcodecs import FP4Codec, Int4Codec, Int8Codec
from p2p.codecs import get_codec
from p2p.aggregate import norm
from p2p.compression import average_part
from trainer.determinism import seeded_normal_

def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

out = {}
FILLS = [("f32", 1_000_003, torch.float32, 0.02, 0.0), ("f32_mean", 300_001, torch.float32, 3.0, 0.5),
         ("f64", 100_001, torch.float64, 1.0, -1.0), ("bf16", 100_001, torch.bfloat16, 0.02, 0.0),
         ("f16", 4_097, torch.float16, 1.0, 0.0), ("one", 1, torch.float32, 1.0, 0.0),
         ("fifteen", 15, torch.float32, 1.0, 0.0), ("seventeen", 17, torch.float32, 1.0, 0.0)]
for name, n, dtype, std, mean in FILLS:
    t = torch.empty(n, dtype=dtype)
    out["normal_" + name] = digest(seeded_normal_(t, std, torch.Generator().manual_seed(n), mean=mean))
strided = torch.empty(301, 7).t()
out["normal_strided"] = digest(seeded_normal_(strided, 0.5, torch.Generator().manual_seed(1)))

g = torch.Generator().manual_seed(2)
n = 200_003  # not a multiple of any vector width or block size
parts = [(w, seeded_normal_(torch.empty(n), 0.01, g)) for w in (4096.0, 7168.0, 1234.0)]
codecs = (get_codec("fp32"), get_codec("fp16"), Int8Codec(), Int8Codec(100), Int4Codec(native=False),
          FP4Codec(native=False))
for codec in codecs:
    out["average_" + codec.name] = hashlib.sha256(average_part(codec, parts)).hexdigest()

# Robust aggregators: honest members only, and with hostile ones (huge values take the path that
# scales the inputs down first; -10x is clipped).
honest = parts + [(5000.0, seeded_normal_(torch.empty(n), 0.01, g)), (3000.0, seeded_normal_(torch.empty(n), 0.02, g))]
hostile = honest[:4] + [(7168.0, torch.where(honest[0][1] < 0, 3.4e38, -3.4e38))]
flipped = honest[:4] + [(7168.0, honest[1][1] * -10)]
for aggregator in ("clip", "centered_clip"):
    for name, contributions in (("honest", honest), ("huge", hostile), ("flipped", flipped)):
        for codec in codecs:
            payload = average_part(codec, contributions, aggregator)
            out[f"robust_{aggregator}_{name}_{codec.name}"] = hashlib.sha256(payload).hexdigest()
for i, (_, x) in enumerate(honest):
    out[f"robust_norm_{i}"] = norm(x).hex()
out["robust_norm_huge"] = norm(hostile[-1][1]).hex()
""")


@pytest.fixture(scope="module")
def child_hashes():
    return by_capability(CHILD)


def test_seeded_normal_has_the_same_bits_under_every_cpu_capability(child_hashes):
    assert_same_everywhere(child_hashes, "normal_")


def test_part_average_has_the_same_bytes_under_every_cpu_capability(child_hashes):
    assert_same_everywhere(child_hashes, "average_")


def test_robust_aggregators_have_the_same_bytes_under_every_cpu_capability(child_hashes):
    assert_same_everywhere(child_hashes, "robust_")


def test_seeded_normal_is_a_normal_distribution():
    x = seeded_normal_(torch.empty(2_000_001, dtype=torch.float64), 2.0, torch.Generator().manual_seed(0), mean=1.0)
    z = (x - 1.0) / 2.0
    assert abs(z.mean().item()) < 4 / math.sqrt(z.numel())
    assert abs(z.std().item() - 1) < 4 / math.sqrt(2 * z.numel())
    for k in (0.5, 1.0, 2.0, 3.0):  # P(|Z| < k) against erf, within 5 standard errors
        p = math.erf(k / math.sqrt(2))
        assert abs((z.abs() < k).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / z.numel())
    # Pairs share a radius but not an angle: neighbours are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([z[0:-1:2], z[1::2]]))[0, 1].item()) < 4 / math.sqrt(z.numel() / 2)


def test_seeded_normal_is_box_muller_on_the_generators_uniforms():
    n = 100_000
    u = torch.empty(n, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(5)).view(-1, 2)
    radius, angle = torch.sqrt(-2 * torch.log1p(-u[:, 0])), 2 * math.pi * u[:, 1]
    exact = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1).view(-1)
    ours = seeded_normal_(torch.empty(n, dtype=torch.float64), 1.0, torch.Generator().manual_seed(5))
    assert torch.allclose(ours, exact, rtol=0, atol=1e-13)
    as_float = seeded_normal_(torch.empty(n), 1.0, torch.Generator().manual_seed(5))
    assert torch.equal(as_float, ours.float())


def test_seeded_normal_values_do_not_depend_on_chunking_and_draw_whole_pairs(monkeypatch):
    whole = seeded_normal_(torch.empty(10_001), 1.0, torch.Generator().manual_seed(3))
    monkeypatch.setattr(determinism, "CHUNK_ELEMS", 1_000)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(seeded_normal_(torch.empty(10_001), 1.0, g), whole)
    # 10_001 values took 10_002 draws: the stream goes on where a fresh one would after them.
    after = torch.Generator().manual_seed(3)
    torch.empty(10_002, dtype=torch.float64).uniform_(generator=after)
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=after))
    # A shorter fill is a prefix of a longer one from the same state.
    assert torch.equal(seeded_normal_(torch.empty(7), 1.0, torch.Generator().manual_seed(3)), whole[:7])


def test_seeded_normal_fills_any_float_dtype_and_layout_in_place():
    reference = seeded_normal_(torch.empty(6, 5), 0.1, torch.Generator().manual_seed(9), mean=2.0)
    strided = torch.empty(5, 6).t()
    assert seeded_normal_(strided, 0.1, torch.Generator().manual_seed(9), mean=2.0) is strided
    assert torch.equal(strided, reference)  # the values in logical (row-major) order
    for dtype in (torch.float16, torch.bfloat16):
        t = seeded_normal_(torch.empty(6, 5, dtype=dtype), 0.1, torch.Generator().manual_seed(9), mean=2.0)
        assert t.dtype == dtype and torch.equal(t, reference.to(dtype))
    param = torch.nn.Parameter(torch.empty(6, 5))
    seeded_normal_(param, 0.1, torch.Generator().manual_seed(9), mean=2.0)
    assert torch.equal(param.detach(), reference) and param.requires_grad
    assert seeded_normal_(torch.empty(0), 1.0, torch.Generator()).numel() == 0
    assert torch.equal(seeded_normal_(torch.empty(4), 0.0, torch.Generator(), mean=0.25), torch.full((4,), 0.25))


@pytest.mark.parametrize("tensor, std, generator, mean", [
    (torch.empty(3, dtype=torch.int64), 1.0, torch.Generator(), 0.0),
    (torch.empty(3), -1.0, torch.Generator(), 0.0),
    (torch.empty(3), float("nan"), torch.Generator(), 0.0),
    (torch.empty(3), 1.0, torch.Generator(), float("inf")),
    (torch.empty(3), 1.0, None, 0.0),
])
def test_seeded_normal_rejects_bad_arguments(tensor, std, generator, mean):
    with pytest.raises(ValueError):
        seeded_normal_(tensor, std, generator, mean=mean)
