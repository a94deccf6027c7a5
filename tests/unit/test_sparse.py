"""The sparse codec (p2p/sparsecodec.py): what it keeps, its exact bytes, its names, every way a
hostile payload can be wrong, and how error feedback carries what a round did not deliver."""

import asyncio

import pytest
import torch

from p2p import sparsename
from p2p.codec import CodecError
from p2p.codecs import get_codec
from p2p.compression import CompressingMember, part_bounds
from p2p.contribution import Contribution
from p2p.sparsecodec import SCALE_LIMIT, SparseCodec, _pack

pytestmark = pytest.mark.timeout(60)


def test_default_format_sends_136x_fewer_bytes_than_fp32_and_the_average_62x():
    codec = get_codec("sparse")
    assert (codec.chunk, codec.keep, codec.bits, codec.index_bits) == (4096, 64, 2, 12)
    assert codec.wire_bytes(4096) == 8 + 64 * 12 // 8 + 64 * 2 // 8 == 120
    assert codec.average.wire_bytes(4096) == 8 + 128 * 12 // 8 + 128 * 4 // 8 == 264
    assert 4 * 25_000_000 / codec.wire_bytes(25_000_000) > 136
    assert get_codec("sparse-k128").wire_bytes(4096) == 8 + 192 + 32
    # A short last chunk keeps its share, at least one value.
    assert codec.kept(1) == 1 and codec.kept(2048) == 32 and codec.kept(100) == 2
    assert codec.wire_bytes(4096 + 100) == 16 + -(-66 * 12 // 8) + -(-66 * 2 // 8)
    assert codec.wire_bytes(0) == 0 and codec.decode(b"", 0).numel() == 0


def test_names_carry_every_setting_and_defaults_are_written_out():
    assert get_codec("sparse-c4096-k64") is get_codec("sparse")
    codec = get_codec("sparse-c1024-k8-b3-ak32-ab8")
    assert (codec.chunk, codec.keep, codec.bits, codec.average.keep, codec.average.bits) == (1024, 8, 3, 32, 8)
    assert codec.name == "sparse-c1024-k8-b3-ak32-ab8" and codec.average.name == codec.name + "/average"
    for bad in ("sparse-k0", "sparse-c1000", "sparse-b1", "sparse-b9", "sparse-k64-c4096", "sparse-k5000",
                "sparse-kk", "sparse-k1-k2"):
        with pytest.raises(ValueError, match="swarm.codec"):
            get_codec(bad)
    assert sparsename.parse("fp32") is None
    assert sparsename.canonical(sparsename.parse("sparse-k64-ab4")) == "sparse"


def test_keeps_the_largest_values_of_each_chunk_ties_to_the_lower_index():
    codec = SparseCodec(chunk=64, keep=4, bits=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 5 + 10, generator=gen)
    x[64:128] = 0.5  # all tied: the first four indices win
    x[128:192] = 0.0  # nothing to keep: zeros at the first four indices
    x[200] = -7.0
    decoded = torch.empty_like(x)
    y = codec.decode(codec.encode(x, decoded), x.numel())
    assert torch.equal(y, decoded)
    for c in range(6):
        chunk, out = x[64 * c : 64 * (c + 1)], y[64 * c : 64 * (c + 1)]
        kept = codec.kept(chunk.numel())
        support = codec.support(codec.encode(x), x.numel())[64 * c : 64 * (c + 1)]
        assert int(support.sum()) == kept
        top = sorted(range(chunk.numel()), key=lambda i: (-abs(float(chunk[i])), i))[:kept]
        assert sorted(top) == support.nonzero().view(-1).tolist()
        mags = chunk[support].abs()
        lo, hi = float(mags.min()), float(mags.max())
        step = (hi - lo) / 3
        # Kept values keep their sign and land within half a level of their magnitude.
        assert ((out[support] - chunk[support]).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
        assert (torch.sign(out[support]) * torch.sign(chunk[support]) >= 0).all()
        assert (out[~support] == 0).all()
    assert torch.equal(support_of(codec, x)[64:68], torch.ones(4, dtype=torch.bool))
    assert float(y[200]) == -7.0


def support_of(codec, x):
    return codec.support(codec.encode(x), x.numel())


def test_chunks_encode_alone_so_pieces_decode_as_the_whole():
    codec = SparseCodec(chunk=256, keep=8)
    x = torch.randn(256 * 7 + 33, generator=torch.Generator().manual_seed(1))
    whole = codec.decode(codec.encode(x), x.numel())
    cut = 256 * 3
    pieces = torch.cat([codec.decode(codec.encode(x[:cut].contiguous()), cut),
                        codec.decode(codec.encode(x[cut:].contiguous()), x.numel() - cut)])
    assert torch.equal(whole, pieces)


def payload_fields(codec, data, numel):
    """(scales, index stream, code stream) byte ranges of a payload."""
    chunks, count, index_bytes, code_bytes = codec._layout(numel)
    return (0, 8 * chunks), (8 * chunks, 8 * chunks + index_bytes), (8 * chunks + index_bytes, len(data))


def rebuild(codec, numel, scales, indices, codes) -> bytes:
    return b"".join([torch.tensor(scales, dtype=torch.float32).view(torch.uint8).numpy().tobytes(),
                     _pack(torch.tensor(indices), codec.index_bits).numpy().tobytes(),
                     _pack(torch.tensor(codes), codec.bits).numpy().tobytes()])


@pytest.mark.parametrize("bad, reason", [
    (dict(indices=[3, 3, 5, 7]), "bad_index"),  # a duplicate
    (dict(indices=[9, 9, 9, 9]), "bad_index"),  # every entry on one coordinate
    (dict(indices=[5, 3, 6, 7]), "bad_index"),  # out of order
    (dict(scales=[float("nan"), 0.1]), "non_finite_scale"),
    (dict(scales=[0.1, float("inf")]), "non_finite_scale"),
    (dict(scales=[-0.1, 0.1]), "negative_scale"),
    (dict(scales=[0.1, SCALE_LIMIT * 2]), "scale_overflow"),
])
def test_a_hostile_payload_is_refused_with_its_reason(bad, reason):
    codec = SparseCodec(chunk=64, keep=4)
    fields = dict(scales=[0.1, 0.2], indices=[1, 2, 3, 60], codes=[0, 1, 2, 3])
    fields.update(bad)
    payload = rebuild(codec, 64, fields["scales"], fields["indices"], fields["codes"])
    assert len(payload) == codec.wire_bytes(64)
    for check in (codec.decode, codec.check, codec.support):
        with pytest.raises(CodecError) as e:
            check(payload, 64)
        assert e.value.reason == reason


def test_an_index_beyond_a_short_last_chunk_and_padding_bits_are_refused():
    codec = SparseCodec(chunk=64, keep=4)
    numel = 64 + 20  # the last chunk has 20 values and keeps 2
    good = rebuild(codec, numel, [0.1, 0.1, 0.1, 0.1], [1, 2, 3, 4, 5, 19], [0] * 6)
    codec.check(good, numel)
    beyond = rebuild(codec, numel, [0.1, 0.1, 0.1, 0.1], [1, 2, 3, 4, 5, 20], [0] * 6)
    with pytest.raises(CodecError, match="bad_index"):
        codec.decode(beyond, numel)
    # 6 entries x 6 index bits = 36 bits: the 5th byte's high nibble is padding.
    (_, _), (i0, i1), (_, _) = payload_fields(codec, good, numel)
    padded = bytearray(good)
    padded[i1 - 1] |= 0x80
    with pytest.raises(CodecError, match="bad_padding"):
        codec.decode(bytes(padded), numel)
    with pytest.raises(CodecError, match="bad_size"):
        codec.decode(good + b"\0", numel)


def test_the_largest_legal_values_decode_finite_and_random_bytes_never_decode_non_finite():
    codec = SparseCodec(chunk=64, keep=4, bits=8)
    biggest = rebuild(codec, 64, [SCALE_LIMIT, SCALE_LIMIT], [0, 1, 2, 3], [127, 255, 0, 128])
    y = codec.decode(biggest, 64)
    assert torch.isfinite(y).all() and float(y[0]) == SCALE_LIMIT * 128 and float(y[1]) == -SCALE_LIMIT * 128
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        raw = torch.randint(0, 256, (codec.wire_bytes(200),), generator=gen, dtype=torch.uint8).numpy().tobytes()
        try:
            assert torch.isfinite(codec.decode(raw, 200)).all()
        except CodecError as e:
            assert e.reason in ("non_finite_scale", "negative_scale", "scale_overflow", "bad_index", "bad_padding")


def test_non_finite_input_is_refused():
    x = torch.randn(300)
    x[7] = float("nan")
    with pytest.raises(CodecError, match="non_finite_input"):
        get_codec("sparse").encode(x)


@pytest.mark.parametrize("in_place", [True, False])
def test_what_the_average_dropped_stays_in_the_residual(in_place):
    codec = SparseCodec(chunk=64, keep=8, average_keep=4)
    flat = torch.randn(64 * 4, generator=torch.Generator().manual_seed(4))
    original = flat.clone()
    residual = flat if in_place else torch.empty_like(flat)
    mine = Contribution(flat, codec, residual, None if in_place else torch.empty(64 * 2), (0, 64 * 2))
    pieces = [[(0, 64), (64, 128)], [(128, 192), (192, 256)]]
    for part in pieces:
        for start, end in part:
            mine.encode(start, end, own=start < 128)
    # Each averaged piece keeps every other value of what we sent.
    sent = torch.cat([codec.decode(codec.encode(original[s:e].contiguous()), e - s) for p in pieces for s, e in p])
    kept = sent != 0
    kept[::2] = False
    mine.write_residual(pieces, lambda j, k: kept[pieces[j][k][0] : pieces[j][k][1]], decay=0.5)
    expected = torch.where(kept, original - sent, original) * 0.5
    assert torch.equal(mine.residual, expected)


def test_error_feedback_delivers_what_both_encodings_dropped_over_rounds():
    # Two members send a vector of their own every round, each 4 values per chunk; the average
    # keeps 6 of the up to 8. Nothing is lost but the average's rounding (8 bits here): what was
    # applied plus what the members still hold is what they put in.
    torch.manual_seed(5)
    codec = SparseCodec(chunk=256, keep=4, bits=2, average_keep=6, average_bits=8)
    targets = [torch.randn(1024), torch.randn(1024)]

    class Exact:  # the owners' exact mean of the members' decoded inputs
        def __init__(self):
            self.inputs = []

        async def average(self, tensors, weight, round):
            self.inputs.append(tensors[0].clone())
            while len(self.inputs) < 2 * (round + 1):
                await asyncio.sleep(0)
            return [sum(self.inputs[2 * round : 2 * round + 2]) / 2]

    async def rounds(n):
        inner = Exact()
        members = [CompressingMember(inner, codec, 2) for _ in range(2)]
        applied = torch.zeros(1024)
        for r in range(n):
            outs = await asyncio.gather(*(m.average([t.clone()], 1.0, r) for m, t in zip(members, targets)))
            assert torch.equal(outs[0][0], outs[1][0])
            applied += outs[0][0]
        return applied, sum(m._ef.residual for m in members) / 2

    applied, held = asyncio.run(rounds(60))
    total = 60 * (targets[0] + targets[1]) / 2
    assert (applied + held - total).norm() / total.norm() < 0.01
    assert (applied - total).norm() / total.norm() > 0.05  # much of it is still held: a real test


@pytest.mark.parametrize("native", [True, False])
def test_values_beyond_the_formats_limit_encode_as_the_limit_and_decode(native):
    codec = SparseCodec(chunk=64, keep=4, native=native)
    x = torch.zeros(64)
    x[:3] = torch.tensor([3.4e38, -1e37, 1.0])
    decoded = torch.empty_like(x)
    y = codec.decode(codec.encode(x, decoded), 64)
    assert torch.equal(y, decoded) and torch.isfinite(y).all()
    assert float(y[0]) == SCALE_LIMIT and float(y[1]) == -SCALE_LIMIT
