"""Wire codecs: error bounds, exact sizes, byte layout, determinism, hostile payloads
(error feedback on top of them: test_feedback.py)."""

import numpy as np
import pytest
import torch

from p2p.blockcodecs import FP4Codec, Int4Codec, Int8Codec
from p2p.codec import CodecError
from p2p.codecs import CODECS, get_codec
from p2p.compression import piece_bounds

pytestmark = pytest.mark.timeout(60)

BLOCK = 256
BLOCK_CODECS = ("int8", "int4", "fp4")
QMAX = {"int8": 127.0, "int4": 7.0, "fp4": 1.0}
# numel 0 and 1, partial blocks, exact blocks.
SIZES = (0, 1, 2, 3, 255, 256, 257, 1000, 4096)


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def round_trip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(x), x.numel())


def scales_of(payload: bytes, numel: int) -> torch.Tensor:
    nblocks = -(-numel // BLOCK)
    return torch.from_numpy(np.frombuffer(payload[: 4 * nblocks], dtype="<f4").copy())


def per_block(values: torch.Tensor) -> torch.Tensor:
    """Values padded with zeros to whole blocks, one block per row."""
    padded = torch.zeros(-(-values.numel() // BLOCK) * BLOCK)
    padded[: values.numel()] = values
    return padded.view(-1, BLOCK)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("name", list(CODECS))
def test_wire_bytes_exact_and_shape(name, numel):
    codec = get_codec(name)
    x = gaussian(numel)
    payload = codec.encode(x)
    assert isinstance(payload, bytes) and len(payload) == codec.wire_bytes(numel)
    y = codec.decode(payload, numel)
    assert y.dtype == torch.float32 and y.shape == (numel,) and torch.isfinite(y).all()


def test_fp32_exact_fp16_bf16_relative():
    x = gaussian(10_000) * 10.0 ** torch.randint(-4, 4, (10_000,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(round_trip("fp32", x).view(torch.int32), x.view(torch.int32))
    # Round to nearest: half a unit in the last place of an 11-bit / 8-bit
    # significand; fp16 subnormals (below 2^-14) have a fixed step of 2^-24.
    assert ((round_trip("fp16", x) - x).abs() <= x.abs() * 2.0**-11 + 2.0**-25).all()
    assert ((round_trip("bf16", x) - x).abs() <= x.abs() * 2.0**-8).all()


def test_fp16_saturates_instead_of_overflowing():
    y = round_trip("fp16", torch.tensor([1e6, -1e6, 1.0]))
    assert y.tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("numel", (257, 1000, 20_001))
@pytest.mark.parametrize("name", ("int8", "int4"))
def test_uniform_grid_error_at_most_half_a_step(name, numel):
    x = gaussian(numel) * 1e-3
    payload = get_codec(name).encode(x)
    scale = scales_of(payload, numel)
    blocks = per_block(x)
    assert torch.allclose(scale, blocks.abs().amax(dim=1) / QMAX[name])
    error = per_block(get_codec(name).decode(payload, numel) - x)
    assert (error.abs() <= scale.unsqueeze(1) * (0.5 + 1e-6)).all()


def test_fp4_error_bound_and_grid():
    x = gaussian(20_001) * 1e-2
    payload = get_codec("fp4").encode(x)
    absmax = scales_of(payload, x.numel())
    y = get_codec("fp4").decode(payload, x.numel())
    # Nearest power of two is off by at most a third of the value; below 2^-7
    # of the block's absmax a value goes to 0 (off by at most absmax / 128).
    bound = torch.maximum(per_block(x).abs() / 3, absmax.unsqueeze(1) / 128) * (1 + 1e-6)
    assert (per_block(y - x).abs() <= bound).all()
    ratio = (per_block(y).abs() / absmax.unsqueeze(1)).flatten()
    grid = torch.tensor([0.0] + [2.0**-k for k in range(7)])
    assert torch.isin(ratio, grid).all()


def test_fp4_rounds_to_nearest_ties_away_from_zero():
    x = torch.tensor([1.0, 0.75, 0.74, -0.375, 2.0**-7, 0.99 * 2.0**-7, 0.0, -0.0, 0.012, -2.0**-6])
    expected = [1.0, 1.0, 0.5, -0.5, 2.0**-6, 0.0, 0.0, 0.0, 2.0**-6, -(2.0**-6)]
    assert round_trip("fp4", x).tolist() == expected


def test_fp4_table_encoding_is_nearest_grid_point_for_every_kind_of_value():
    # Reference: the nearest of ±{0, 2^-6, ..., 1} times absmax, ties away from zero, in float64.
    gen = torch.Generator().manual_seed(4)
    mids = torch.tensor([2.0**-7] + [1.5 * 2.0**-k for k in range(1, 7)])
    edges = torch.cat([mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.ones(1))])
    magnitudes = torch.cat([edges, torch.rand(20_000, generator=gen),
                            2.0 ** -torch.randint(0, 150, (5_000,), generator=gen).float(), torch.tensor([0.0, 1e-45])])
    x = torch.cat([torch.tensor([1.0]), magnitudes, -magnitudes])  # absmax 1: one scale for all
    codec = FP4Codec(block_size=2 * (x.numel() // 2 + 1))
    y = codec.decode(codec.encode(x), x.numel()).double()
    grid = torch.tensor([0.0] + [2.0**-k for k in range(6, -1, -1)], dtype=torch.float64)
    m = x.double().abs().unsqueeze(1)
    distance = (m - grid).abs()
    best = distance.min(dim=1, keepdim=True).values
    nearest = torch.where(distance == best, grid, -1.0).max(dim=1).values  # a tie goes to the larger
    assert torch.equal(y.abs(), nearest)
    assert torch.equal(torch.signbit(y) & (y != 0), torch.signbit(x) & (y != 0))


def test_block_layout_matches_the_documented_format():
    numel = 2 * BLOCK + 7  # a short odd last block: its last byte carries a pad nibble
    x = gaussian(numel)
    nblocks, lengths = 3, [BLOCK, BLOCK, 7]
    for name in BLOCK_CODECS:
        payload = get_codec(name).encode(x)
        scale = np.repeat(np.frombuffer(payload[: 4 * nblocks], dtype="<f4"), BLOCK)[:numel]
        body = np.frombuffer(payload[4 * nblocks :], dtype=np.uint8)
        if name == "int8":
            values = body.view(np.int8).astype(np.float32) * scale
        else:
            codes, offset = [], 0
            for length in lengths:  # byte j: value j low, value j + ceil(length / 2) high
                block = body[offset : offset + (length + 1) // 2]
                codes.append(np.concatenate([block & 15, block >> 4])[:length])
                offset += len(block)
            assert offset == len(body) and body[-1] >> 4 == 8
            level = np.concatenate(codes).astype(np.float32) - 8
            assert level.min() >= -7
            grid = level if name == "int4" else np.where(level != 0, np.sign(level) * np.exp2(np.abs(level) - 7), 0)
            values = grid.astype(np.float32) * scale
        decoded = get_codec(name).decode(payload, numel).numpy()
        assert np.array_equal(decoded.view(np.int32), (values + 0.0).astype(np.float32).view(np.int32)), name


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_chunked_steps_give_the_same_bytes(name):
    # Codecs work through long vectors in steps of whole blocks; steps of
    # 2 blocks here must give exactly the bytes of one step.
    default, chunked = get_codec(name), type(get_codec(name))(chunk_elems=2 * BLOCK)
    for numel in (0, 1, 511, 512, 513, 5 * 512 + 77):
        x = gaussian(numel)
        payload = default.encode(x)
        assert chunked.encode(x) == payload
        assert torch.equal(chunked.decode(payload, numel).view(torch.int32), default.decode(payload, numel).view(torch.int32))
    payload = bytearray(default.encode(gaussian(5 * 512 + 77)))
    payload[4 * 11 + 3 * 512 // (4 if name != "int8" else 2)] = 0x80 if name == "int8" else 0x00
    with pytest.raises(CodecError) as err:
        chunked.decode(payload, 5 * 512 + 77)  # a bad code in a later step
    assert err.value.reason == "bad_code"


@pytest.mark.parametrize("codec", [*CODECS.values(), Int8Codec(block_size=6), Int4Codec(block_size=130)],
                         ids=lambda c: c.name)
def test_a_part_streamed_in_pieces_decodes_like_the_whole_part(codec):
    # The all-reduce encodes each part piece by piece; error feedback, the simulator and
    # every member's result rely on that giving exactly the values of the whole part.
    x = gaussian(3000, seed=5)
    start, end = 123, 2_901  # a part does not start on a block boundary of the vector
    part = x[start:end].contiguous()
    pieces = piece_bounds(start, end, codec, 700)
    assert pieces[0][0] == start and pieces[-1][1] == end and len(pieces) > 2
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all((s - start) % codec.align == 0 and e - s <= max(700, codec.align) for s, e in pieces)
    joined = torch.cat([codec.decode(codec.encode(x[s:e]), e - s) for s, e in pieces])
    assert torch.equal(joined, codec.decode(codec.encode(part), part.numel()))
    assert sum(codec.wire_bytes(e - s) for s, e in pieces) == codec.wire_bytes(part.numel())


def test_piece_bounds_edge_cases():
    int8 = get_codec("int8")
    assert piece_bounds(10, 10, int8, 1 << 20) == []  # an empty part has no pieces
    assert piece_bounds(0, 1000, int8, 100) == [(0, 256), (256, 512), (512, 768), (768, 1000)]  # >= one block
    assert piece_bounds(5, 12, get_codec("fp32"), 4) == [(5, 9), (9, 12)]


def test_compression_ratios():
    numel = 1000 * BLOCK
    raw = 4 * numel
    ratio = {name: raw / get_codec(name).wire_bytes(numel) for name in CODECS}
    assert ratio["fp32"] == 1.0 and ratio["fp16"] == 2.0 and ratio["bf16"] == 2.0
    # One fp32 scale per 256 values: 1024 / (256 + 4) bytes and 1024 / (128 + 4) bytes.
    assert ratio["int8"] == pytest.approx(1024 / 260) and ratio["int8"] > 3.9
    assert ratio["int4"] == ratio["fp4"] == pytest.approx(1024 / 132) and ratio["fp4"] >= 7.5


@pytest.mark.parametrize("name", list(CODECS))
def test_deterministic_and_independent_of_buffer_type(name):
    codec, x = get_codec(name), gaussian(5000)
    payload = codec.encode(x)
    assert codec.encode(x.clone()) == payload
    first = codec.decode(payload, x.numel())
    for buffer in (payload, bytearray(payload), memoryview(payload), memoryview(bytearray(payload))):
        assert torch.equal(codec.decode(buffer, x.numel()).view(torch.int32), first.view(torch.int32))


def test_decoded_tensor_does_not_alias_the_payload():
    buffer = bytearray(get_codec("fp32").encode(torch.ones(4)))
    y = get_codec("fp32").decode(buffer, 4)
    buffer[:] = bytes(len(buffer))
    assert y.tolist() == [1.0] * 4


@pytest.mark.parametrize("name", list(CODECS))
def test_mis_sized_payloads_are_rejected(name):
    codec, numel = get_codec(name), 1000
    payload = codec.encode(gaussian(numel))
    for data, n in ((payload[:-1], numel), (payload + b"\0", numel), (payload[:10], numel),
                    (b"", numel), (payload, numel + 2), (payload, numel - 2), (payload, -1)):
        with pytest.raises(CodecError) as err:
            codec.decode(data, n)
        assert err.value.reason == "bad_size"
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
def test_non_finite_input_is_not_encoded(name, bad):
    x = gaussian(600)
    x[300] = bad
    with pytest.raises(CodecError) as err:
        get_codec(name).encode(x)
    assert err.value.reason == "non_finite_input"


@pytest.mark.parametrize("name", ("fp32", "fp16", "bf16"))
@pytest.mark.parametrize("bad", (float("nan"), float("inf")))
def test_non_finite_float_payload_is_rejected(name, bad):
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    values = torch.zeros(10, dtype=dtype)
    values[7] = bad
    with pytest.raises(CodecError) as err:
        get_codec(name).decode(values.view(torch.uint8).numpy().tobytes(), 10)
    assert err.value.reason == "non_finite_value"


@pytest.mark.parametrize("name", BLOCK_CODECS)
@pytest.mark.parametrize("scale, reason", [(float("nan"), "non_finite_scale"), (float("inf"), "non_finite_scale"),
                                           (-1.0, "negative_scale"), (1e38, "scale_overflow")])
def test_poisoned_scales_are_rejected(name, scale, reason):
    codec = get_codec(name)
    payload = bytearray(codec.encode(gaussian(600)))
    payload[4:8] = np.float32(scale).tobytes()  # scale of the second block
    with pytest.raises(CodecError) as err:
        codec.decode(payload, 600)
    assert err.value.reason == reason


def test_int8_code_outside_the_symmetric_grid_is_rejected():
    payload = bytearray(get_codec("int8").encode(gaussian(300)))
    payload[-1] = 0x80
    with pytest.raises(CodecError) as err:
        get_codec("int8").decode(payload, 300)
    assert err.value.reason == "bad_code"


@pytest.mark.parametrize("name", ("int4", "fp4"))
def test_bad_pad_nibble_and_code_zero_are_rejected(name):
    payload = get_codec(name).encode(gaussian(301))
    padded = bytearray(payload)
    padded[-1] ^= 0x10  # pad nibble 8 -> 9
    with pytest.raises(CodecError) as err:
        get_codec(name).decode(padded, 301)
    assert err.value.reason == "bad_padding"
    for position in (4 * 2 + 5, 4 * 2 + 140, len(payload) - 2):  # code 0 in a full block and in the short one
        for mask in (0xF0, 0x0F):
            zeroed = bytearray(payload)
            zeroed[position] &= mask
            with pytest.raises(CodecError) as err:
                get_codec(name).decode(zeroed, 301)
            assert err.value.reason == "bad_code"


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_all_zero_blocks_and_single_values(name):
    x = torch.cat([torch.zeros(BLOCK), gaussian(BLOCK), torch.zeros(10)])
    payload = get_codec(name).encode(x)
    assert scales_of(payload, x.numel())[[0, 2]].tolist() == [0.0, 0.0]
    y = get_codec(name).decode(payload, x.numel())
    assert torch.equal(y[:BLOCK], torch.zeros(BLOCK)) and torch.equal(y[-10:], torch.zeros(10))
    for value in (0.0, 3.5, -2e-7):  # a lone value is its block's absmax, so it survives exactly
        assert torch.equal(round_trip(name, torch.tensor([value])), torch.tensor([value]))


def test_registry_and_custom_block_size():
    assert list(CODECS) == ["fp32", "fp16", "bf16", "int8", "int4", "fp4"]
    assert all(codec.name == name for name, codec in CODECS.items())
    with pytest.raises(ValueError, match=r"swarm.codec: unknown codec 'int3' \(choose from fp32, fp16"):
        get_codec("int3")
    codec = Int8Codec(block_size=128)
    assert codec.name == "int8-b128" and codec.wire_bytes(300) == 3 * 4 + 300
    x = gaussian(300)
    assert torch.allclose(codec.decode(codec.encode(x), 300), x, atol=x.abs().max().item() / 127)
    for bad in (0, 1, 255):
        with pytest.raises(ValueError):
            FP4Codec(block_size=bad)


def test_encode_wants_flat_contiguous_float32_cpu():
    for x in (torch.zeros(4, dtype=torch.float64), torch.zeros(2, 2), torch.zeros(8)[::2]):
        with pytest.raises(ValueError, match="1-D contiguous float32"):
            get_codec("int8").encode(x)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decode_into_a_given_tensor_writes_the_same_values(name):
    codec = get_codec(name)
    x = torch.randn(3 * 256 + 17)
    payload = codec.encode(x)
    whole = torch.full((2000,), 7.0)
    into = codec.decode(payload, x.numel(), whole[100 : 100 + x.numel()])
    assert into.data_ptr() == whole[100:].data_ptr()
    assert torch.equal(whole[100 : 100 + x.numel()].view(torch.int32), codec.decode(payload, x.numel()).view(torch.int32))
    assert torch.all(whole[:100] == 7.0) and torch.all(whole[100 + x.numel() :] == 7.0)
    with pytest.raises(ValueError, match="out="):
        codec.decode(payload, x.numel(), torch.empty(x.numel() + 1))


@pytest.mark.parametrize("numel", SIZES + (5 * 256 + 77,))
@pytest.mark.parametrize("name", sorted(CODECS))
def test_encode_writes_exactly_what_decoding_its_payload_gives(name, numel):
    codec = get_codec(name)
    # Six decades of magnitude, an all-zero block and negative zeros (which round to a level of -0):
    # every bit of the values written while encoding must match decoding the payload afterwards.
    x = gaussian(numel) * torch.logspace(-6, 3, numel)
    x[256:512] = 0.0
    x[600:700] = -0.0
    x[1:3] = -1e-9
    decoded = torch.full((numel,), float("nan"))
    payload = codec.encode(x, decoded)
    assert payload == codec.encode(x)
    assert torch.equal(decoded.view(torch.int32), codec.decode(payload, numel).view(torch.int32))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encode_refuses_a_misshapen_decoded_buffer(name):
    x = gaussian(300)
    with pytest.raises(ValueError, match="decoded="):
        get_codec(name).encode(x, torch.empty(299))
    with pytest.raises(ValueError, match="decoded="):
        get_codec(name).encode(x, torch.empty(300, dtype=torch.float64))
    with pytest.raises(CodecError, match="non_finite_input"):
        get_codec(name).encode(torch.tensor([1.0, float("inf")]), torch.empty(2))



def test_the_config_knows_every_codec_by_name():
    from p2p.config import CODEC_NAMES, SwarmConfig

    assert tuple(CODECS) == CODEC_NAMES
    with pytest.raises(ValueError, match="swarm.codec"):
        SwarmConfig(codec="int2")


@pytest.mark.parametrize("name", sorted(CODECS))
def test_check_refuses_exactly_what_decode_refuses(name):
    """Corrupted payloads (random bytes written over a valid one): ``check`` raises the reason
    ``decode`` raises, and passes only payloads that decode (what a round keeps encoded)."""
    codec, gen = CODECS[name], torch.Generator().manual_seed(7)
    numel = 1000 + 3  # an odd last block
    payload = bytearray(codec.encode(torch.randn(numel, generator=gen)))
    outcomes = set()
    for trial in range(300):
        data = bytearray(payload)
        for _ in range(1 + trial % 4):
            at = int(torch.randint(len(data), (1,), generator=gen))
            data[at] = int(torch.randint(256, (1,), generator=gen))
        try:
            codec.decode(bytes(data), numel)
            expected = None
        except CodecError as e:
            expected = e.reason
        try:
            codec.check(bytes(data), numel)
            got = None
        except CodecError as e:
            got = e.reason
        assert (got is None) == (expected is None), (trial, got, expected)
        outcomes.add(expected is None)
    assert outcomes == {True, False}  # both kinds were tried
    with pytest.raises(CodecError, match="bad_size"):
        codec.check(bytes(payload[:-1]), numel)
