"""The C kernels of the block codecs (int8, int4, fp4) and of the sparse codec against their torch reference:
same bytes, same values, same errors; and how they are built, cached and given up on."""

import logging
import os
import shutil
import subprocess

import pytest
import torch

from p2p import native, sparsename
from p2p.blockcodecs import FP4Codec, Int4Codec, Int8Codec
from p2p.codec import CodecError
from p2p.sparsecodec import SCALE_LIMIT, SparseCodec, _pack

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler to build the kernels"),
    pytest.mark.skipif(os.environ.get("GONKA_NATIVE") == "0", reason="GONKA_NATIVE=0 turns the kernels off"),
]

CLASSES = {"int8": Int8Codec, "int4": Int4Codec, "fp4": FP4Codec}
NIBBLE = ("int4", "fp4")  # two codes per byte: a pad nibble, code 0 invalid
SIZES = (0, 1, 2, 3, 5, 255, 256, 257, 511, 4097, 100_003)


def pair(name: str, block: int):
    fast, reference = CLASSES[name](block), CLASSES[name](block, native=False)
    assert fast.kernels() is not None, "the kernels did not build"
    assert reference.kernels() is None
    return fast, reference


def inputs(n: int, seed: int):
    """Gaussians at many magnitudes, with zeros and signed zeros, near fp32's top, and subnormal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    yield x
    yield x * 1e-30
    yield x * 1e30
    mixed = x.clone()
    mixed[::3], mixed[1::5] = 0.0, -0.0
    yield mixed
    if n:
        yield x / x.abs().max() * 3e38  # absmax / qmax above SCALE_LIMIT: the scale is clamped
    yield torch.where(torch.rand(n, generator=g) < 0.5, x, -0.0 * x) * 1e-40
    yield torch.zeros(n)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def reason(codec, data, numel):
    try:
        return codec.decode(data, numel), None
    except CodecError as e:
        return None, e.reason


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("block", (2, 6, 256, 1000))
def test_same_bytes_and_values_as_the_torch_code(name, block):
    fast, reference = pair(name, block)
    for n in SIZES:
        for x in inputs(n, seed=n):
            got, want = torch.empty(n), torch.empty(n)
            payload = fast.encode(x, got)
            assert payload == reference.encode(x, want), (n, block)
            assert torch.equal(bits(got), bits(want))  # signed zeros included
            assert torch.equal(bits(fast.decode(payload, n)), bits(got))
            assert torch.equal(bits(reference.decode(payload, n)), bits(got))


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("block", (6, 256))
def test_hostile_bytes_fail_the_same_way(name, block):
    fast, reference = pair(name, block)
    g = torch.Generator().manual_seed(1)
    seen = set()
    for n in (1, 3, 5, 257, 4097):
        nblocks = -(-n // block)
        valid = fast.encode(torch.randn(n, generator=g))
        for trial in range(40):
            junk = bytearray(torch.randint(0, 256, (len(valid),), generator=g, dtype=torch.uint8).numpy().tobytes())
            if trial % 2:  # valid scales, random codes: reach the code and padding checks
                junk[: 4 * nblocks] = valid[: 4 * nblocks]
            if trial % 4 == 3:  # only valid codes: 8..15 in each nibble, no int8 code -128 (0x80)
                mask = 0x88 if name in NIBBLE else 0x40
                junk[4 * nblocks:] = bytes(b | mask for b in junk[4 * nblocks:])
            got, got_reason = reason(fast, bytes(junk), n)
            want, want_reason = reason(reference, bytes(junk), n)
            assert got_reason == want_reason, (n, trial)
            if want_reason is None:
                assert torch.equal(bits(got), bits(want))
            seen.add(want_reason)
    assert {"non_finite_scale", "bad_code", None} <= seen


def same_reason(fast, reference, data, numel):
    got = reason(fast, bytes(data), numel)[1]
    assert got == reason(reference, bytes(data), numel)[1]
    return got


@pytest.mark.parametrize("name", CLASSES)
def test_each_scale_error_comes_before_any_code_error(name):
    fast, reference = pair(name, 4)
    n = 5  # two blocks, the second of one value
    payload = bytearray(fast.encode(torch.arange(1.0, 6.0)))
    payload[8] = 0x80 if name == "int8" else 0x00  # an invalid first code, found only after the scales
    assert same_reason(fast, reference, payload, n) == "bad_code"
    cases = {
        "non_finite_scale": (0, torch.tensor([float("inf")])),
        "negative_scale": (4, torch.tensor([-1.0])),
        "scale_overflow": (0, torch.tensor([2.0**121])),
    }
    for expected, (offset, scale) in cases.items():
        bad = bytearray(payload)
        bad[offset:offset + 4] = scale.numpy().tobytes()
        assert same_reason(fast, reference, bad, n) == expected
    bad = bytearray(payload)
    bad[0:4], bad[4:8] = torch.tensor([float("nan")]).numpy().tobytes(), torch.tensor([-1.0]).numpy().tobytes()
    assert same_reason(fast, reference, bad, n) == "non_finite_scale"  # in the torch order, whichever block
    bad[0:4], bad[4:8] = torch.tensor([2.0**121]).numpy().tobytes(), torch.tensor([-1.0]).numpy().tobytes()
    assert same_reason(fast, reference, bad, n) == "negative_scale"


@pytest.mark.parametrize("name", NIBBLE)
def test_padding_error(name):
    fast, reference = pair(name, 4)
    n = 5  # two blocks, the second of one value: a pad nibble
    payload = bytearray(fast.encode(torch.arange(1.0, 6.0)))
    bad = bytearray(payload)
    bad[-1] = (bad[-1] & 0x0F) | 0x30  # the pad nibble must be 8
    assert same_reason(fast, reference, bad, n) == "bad_padding"
    bad[8] = 0x80  # code 0 in the first block comes first
    assert same_reason(fast, reference, bad, n) == "bad_code"


@pytest.mark.parametrize("block", (4, 256))
@pytest.mark.parametrize("at", (0, 3, 4, 299))
def test_int8_code_minus_128_is_refused(block, at):
    fast, reference = pair("int8", block)
    n = 300  # a short last block for both sizes
    payload = bytearray(fast.encode(torch.randn(n, generator=torch.Generator().manual_seed(at))))
    payload[4 * -(-n // block) + at] = 0x80
    assert same_reason(fast, reference, payload, n) == "bad_code"
    payload[4 * -(-n // block) + at] = 0x81  # -127: valid
    assert torch.equal(bits(fast.decode(bytes(payload), n)), bits(reference.decode(bytes(payload), n)))


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
def test_non_finite_input_is_refused(name, bad):
    fast, reference = pair(name, 256)
    x = torch.randn(1000)
    x[700] = bad
    for codec in (fast, reference):
        with pytest.raises(CodecError) as e:
            codec.encode(x)
        assert e.value.reason == "non_finite_input"


# ---- the sparse codec (p2p/sparsecodec.py): the member format and the average's ----

# Names covering keep 1, keep = chunk, chunks of 64 to 4096 and every width 2..8 (member or average).
SPARSE = ("sparse", "sparse-k128", "sparse-c64-k1-b8-ak64-ab2", "sparse-c64-k5-b3-ak2-ab5",
          "sparse-c128-k7-b6-ak33-ab7")


def sparse_pair(name: str, average: bool):
    s = sparsename.parse(name)
    fast, reference = (SparseCodec(s["c"], s["k"], s["b"], s["ak"], s["ab"], native=on) for on in (True, False))
    assert native.kernels() is not None, "the kernels did not build"
    return (fast.average, reference.average) if average else (fast, reference)


def sparse_sizes(chunk: int):
    """Less than a chunk, whole chunks, and a short last chunk."""
    return (0, 1, 2, chunk - 1, chunk, chunk + 1, 3 * chunk + chunk // 3)


def sparse_inputs(n: int, chunk: int, seed: int):
    """inputs() and what a top-k meets besides: ties, all-zero chunks, one value far above the rest."""
    g = torch.Generator().manual_seed(seed)
    yield from inputs(n, seed)
    yield torch.randint(-3, 4, (n,), generator=g).float()  # many ties, zeros and -0.0 below them
    yield torch.full((n,), -0.5)  # every value tied
    yield -torch.zeros(n)
    x = torch.randn(n, generator=g)
    x[:chunk] = 0.0  # an all-zero first chunk
    x[chunk + 3 : chunk + 5] = 3e38  # huge: lo above SCALE_LIMIT, a payload every decoder refuses
    yield x
    yield torch.randn(n, generator=g) ** 9  # magnitudes over many octaves


def sparse_outcome(call):
    try:
        return call(), None
    except CodecError as e:
        return None, e.reason


def same_payload_outcome(fast, reference, data, numel):
    """decode, check and support of fast and reference agree on data: the same values or the same reason."""
    junk = torch.full((numel,), float("nan"))  # decode writes every value, kept or not
    got, got_reason = sparse_outcome(lambda: fast.decode(bytes(data), numel, junk))
    want, want_reason = sparse_outcome(lambda: reference.decode(bytes(data), numel))
    assert got_reason == want_reason
    assert sparse_outcome(lambda: fast.check(bytes(data), numel))[1] == want_reason
    support, support_reason = sparse_outcome(lambda: fast.support(bytes(data), numel))
    assert support_reason == want_reason
    if want_reason is None:
        assert torch.equal(bits(got), bits(want))
        assert torch.equal(support, reference.support(bytes(data), numel))
    return want_reason


@pytest.mark.parametrize("average", (False, True), ids=("member", "average"))
@pytest.mark.parametrize("name", SPARSE)
def test_sparse_same_bytes_and_values_as_the_torch_code(name, average):
    fast, reference = sparse_pair(name, average)
    for n in sparse_sizes(fast.chunk):
        for x in sparse_inputs(n, fast.chunk, seed=n):
            got, want = torch.full((n,), float("nan")), torch.empty(n)
            payload = fast.encode(x, got)
            assert payload == reference.encode(x, want), (n, x[:4])
            assert torch.equal(bits(got), bits(want))  # signed zeros included
            if same_payload_outcome(fast, reference, payload, n) is None:
                assert torch.equal(bits(fast.decode(payload, n)), bits(got))
            else:  # only a value above SCALE_LIMIT gives a payload no one decodes
                assert x.abs().max() > SCALE_LIMIT


@pytest.mark.parametrize("average", (False, True), ids=("member", "average"))
@pytest.mark.parametrize("name", SPARSE)
def test_sparse_hostile_bytes_fail_the_same_way(name, average):
    fast, reference = sparse_pair(name, average)
    g = torch.Generator().manual_seed(2)
    seen = set()
    chunk = fast.chunk
    for n in (1, chunk + 1, 2 * chunk + chunk // 3):
        chunks = -(-n // chunk)
        valid = fast.encode(torch.randn(n, generator=g))
        for trial in range(30):
            junk = bytearray(valid)
            if trial % 3 == 0:  # a few bytes flipped anywhere
                for at in torch.randint(0, len(junk), (1 + trial % 4,), generator=g).tolist():
                    junk[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
            elif trial % 3 == 1:  # valid scales, random streams: the padding and index checks
                streams = torch.randint(0, 256, (len(junk) - 8 * chunks,), generator=g, dtype=torch.uint8)
                junk[8 * chunks:] = streams.numpy().tobytes()
            else:  # anything
                junk = bytearray(torch.randint(0, 256, (len(junk),), generator=g, dtype=torch.uint8).numpy().tobytes())
            seen.add(same_payload_outcome(fast, reference, junk, n))
        assert same_payload_outcome(fast, reference, valid + b"\0", n) == "bad_size"
    assert {"negative_scale", "bad_index", None} <= seen, seen


def sparse_payload(codec, scales, indices, codes) -> bytearray:
    """A payload from its fields, packed as the codec packs them."""
    return bytearray(torch.tensor(scales, dtype=torch.float32).numpy().tobytes()
                     + _pack(torch.tensor(indices), codec.index_bits).numpy().tobytes()
                     + _pack(torch.tensor(codes), codec.bits).numpy().tobytes())


def test_sparse_each_field_error_and_their_order():
    # Chunks of 64 keeping 3 at 3 bits; 94 values: a chunk of 3 kept and one of 30 keeping 2. Five
    # 6-bit indices leave 2 padding bits, five 3-bit codes 1.
    fast, reference = sparse_pair("sparse-c64-k3-b3", average=False)
    n, scales, codes = 94, [0.5, 0.25, 0.0, 1.0], [1, 7, 0, 4, 3]

    def reason(indices, scales=scales, index_padding=0, code_padding=0):
        payload = sparse_payload(fast, scales, indices, codes)
        payload[-3] |= index_padding << 6  # the index stream's last byte (4 bytes of indices, 2 of codes)
        payload[-1] |= code_padding << 7
        return same_payload_outcome(fast, reference, payload, n)

    assert reason([1, 5, 63, 0, 29]) is None  # indices restart in each chunk
    for indices in ([5, 1, 9, 3, 29], [1, 1, 9, 3, 29], [1, 5, 9, 29, 3], [1, 5, 9, 3, 3], [1, 5, 9, 3, 30],
                    [1, 5, 9, 3, 63], [0, 0, 0, 0, 0]):
        assert reason(indices) == "bad_index", indices  # unsorted, duplicated, beyond the short chunk
    nan, inf = float("nan"), float("inf")
    for bad, expected in (([nan, 0, 0, 0], "non_finite_scale"), ([0, 0, 0, -inf], "non_finite_scale"),
                          ([0, -1.0, 0, 0], "negative_scale"), ([0, 0, -0.0, 2.0**120], None),
                          ([0, 2.0**121, 0, 0], "scale_overflow"), ([1e38, 0, 0, 0], "scale_overflow")):
        assert reason([1, 5, 9, 3, 29], scales=bad) == expected, bad
    # Where there are several faults, the first of: any scale, the padding, any index.
    assert reason([1, 5, 9, 3, 29], index_padding=1) == "bad_padding"
    assert reason([1, 5, 9, 3, 29], index_padding=2) == "bad_padding"
    assert reason([1, 5, 9, 3, 29], code_padding=1) == "bad_padding"
    assert reason([9, 5, 9, 3, 30], code_padding=1) == "bad_padding"
    assert reason([9, 5, 9, 3, 30], index_padding=3, code_padding=1) == "bad_padding"
    assert reason([9, 5, 9, 3, 30], scales=[0, 2.0**121, 0, -1.0], index_padding=3) == "negative_scale"
    assert reason([9, 5, 9, 3, 30], scales=[0, 2.0**121, nan, -1.0], code_padding=1) == "non_finite_scale"


@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
def test_sparse_non_finite_input_is_refused(bad):
    fast, reference = sparse_pair("sparse", average=False)
    x = torch.randn(10_000)
    x[7000] = bad
    for codec in (fast, reference, fast.average, reference.average):
        with pytest.raises(CodecError) as e:
            codec.encode(x)
        assert e.value.reason == "non_finite_input"


def test_a_build_is_cached_under_its_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("GONKA_NATIVE_DIR", str(tmp_path / "cache"))
    path = native.build()
    assert path.parent == tmp_path / "cache" and path.name.startswith("nibble-") and path.suffix == ".so"
    stamp = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    assert native.library_path(["some-other-cc"]) != path


def test_a_failed_build_leaves_nothing_and_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GONKA_NATIVE_DIR", str(tmp_path))
    with pytest.raises(subprocess.CalledProcessError):
        native.build(["false"])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CC", "false")
    native.kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="p2p.native"):
            assert native.kernels() is None
        assert "did not build" in caplog.text
        codec = Int4Codec()
        x = torch.randn(1000)
        assert codec.kernels() is None and codec.decode(codec.encode(x), 1000).shape == (1000,)
        sparse = SparseCodec(64, 4)  # the torch code
        assert torch.count_nonzero(sparse.decode(sparse.encode(x), 1000)) == 4 * 15 + 3
    finally:
        native.kernels.cache_clear()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("GONKA_NATIVE", "0")
    native.kernels.cache_clear()
    try:
        assert native.kernels() is None
        assert FP4Codec().kernels() is None
    finally:
        native.kernels.cache_clear()
