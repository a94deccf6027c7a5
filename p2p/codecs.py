"""Wire codecs for pseudo-gradients: fp32, fp16, bf16, int8, int4 and fp4.

The butterfly all-reduce sends each part of a flat fp32 vector once per hop;
these codecs shrink those bytes. Two properties matter more than speed:

- Decoding is a pure function of the bytes: table look-ups and IEEE fp32
  multiplies, no randomness, so every member that decodes the averaged part
  ends with bit-identical values.
- A payload from another peer is untrusted. ``decode`` checks its exact size
  and every field a hostile peer could poison (scales, padding, codes,
  non-finite values) and raises ``CodecError`` with a metric ``reason``
  instead of returning anything that could reach the model.

Wire formats (all little-endian, no header: the receiver knows ``numel`` from
the round, so ``wire_bytes(numel)`` is the exact payload size):

- ``fp32`` / ``fp16`` / ``bf16``: ``numel`` values of that type.
- ``int8``: ``nblocks`` fp32 scales, then ``numel`` int8 codes ``q`` in
  [-127, 127]; value = ``q * scale``, ``scale = absmax / 127`` per block.
- ``int4``: ``nblocks`` fp32 scales, then 4-bit codes, two per byte,
  ``ceil(L / 2)`` bytes per block of ``L`` values (``ceil(numel / 2)`` in
  all). Within a block, with ``h = ceil(L / 2)``, byte ``j`` holds value
  ``j`` in its low nibble and value ``j + h`` in its high nibble; an odd
  block ends with a pad nibble 8. A code is ``8 + q`` for a level ``q`` in
  -7..7 (code 0 is invalid): value = ``q * scale``, ``scale = absmax / 7``.
- ``fp4`` (FP4 E3M0, as in Streaming DiLoCo, arXiv 2501.18512): same layout
  as int4; a level ``q = ±e`` is a sign and a 3-bit exponent ``e`` with no
  mantissa: value = ``sign(q) * 2^(e-7) * scale`` for ``e`` in 1..7 and 0
  for ``q = 0``, ``scale = absmax``. The grid is ±{0, 1/64, 1/32, 1/16, 1/8,
  1/4, 1/2, 1} of the block's absmax, rounded to nearest (ties away from 0).

``nblocks = ceil(numel / block_size)``; block size is 256 unless a codec is
built with another one (its name then says so, e.g. ``int8-b128``, so peers
that agree on a name agree on the format).

int8, int4 and fp4 encode and decode with C kernels (``p2p/nibble.c``, loaded
by ``p2p/native.py``) where they can be built; the torch code here is their
reference and fallback, and gives the same bytes and the same values.
"""

from __future__ import annotations

import abc
import sys

import torch

from p2p import native as native_kernels

if sys.byteorder != "little":  # payloads are the in-memory bytes of torch tensors
    raise ImportError("p2p.codecs assumes a little-endian host")

DEFAULT_BLOCK_SIZE = 256
# Largest legal block scale. A power of two far above any pseudo-gradient, and
# small enough that scale * 127 stays finite, so a scale a hostile peer picks
# can never decode to Inf.
SCALE_LIMIT = 2.0**120
# Elements per encode/decode step: bounds the temporaries (a few times 16 MB)
# while keeping the number of torch ops small. Measured on 2 shared cores:
# when training competes for the cores each op pays a scheduling delay, and
# 2^18-element steps made encoding ~10x slower than 2^22.
CHUNK_ELEMS = 1 << 22


class CodecError(ValueError):
    """A payload (or input) a codec refuses; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _check_input(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"codec input must be a 1-D contiguous float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")


def check_vector(out: torch.Tensor, numel: int, what: str = "decode out=") -> torch.Tensor:
    """``out`` if it is a contiguous fp32 CPU vector of ``numel`` values; ValueError naming ``what`` otherwise."""
    if out.dtype != torch.float32 or out.shape != (numel,) or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"{what} must be a contiguous float32 CPU tensor of shape ({numel},), "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _payload(codec: Codec, data: bytes | bytearray | memoryview, numel: int) -> tuple[torch.Tensor, bool]:
    """The payload as a uint8 tensor after checking its exact size, and whether it is a private copy."""
    if numel < 0:
        raise CodecError("bad_size", f"numel {numel}")
    view, expected = memoryview(data).cast("B"), codec.wire_bytes(numel)
    if view.nbytes != expected:
        raise CodecError("bad_size", f"got {view.nbytes} bytes, expected {expected}")
    if expected == 0:
        return torch.empty(0, dtype=torch.uint8), True
    if view.readonly:  # torch cannot wrap read-only memory without a warning
        return torch.frombuffer(bytearray(view), dtype=torch.uint8), True
    return torch.frombuffer(view, dtype=torch.uint8), False


class Codec(abc.ABC):
    """Turns a flat fp32 vector into bytes and back; subclasses define the format."""

    name: str
    # Pieces of a vector cut at multiples of ``align`` values and encoded one
    # by one decode to exactly the values of the whole vector encoded at once
    # (block codecs: the block size), so a part may be streamed in pieces.
    align: int = 1
    # True if ``decode(encode(x))`` is ``x`` bit for bit (fp32): nothing to feed back.
    exact: bool = False

    @abc.abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """Exact size of ``encode`` of a vector with ``numel`` elements."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor, decoded: torch.Tensor | None = None) -> bytes:
        """Encode a 1-D contiguous float32 CPU tensor; non-finite input raises CodecError.

        ``decoded`` (float32, shaped like ``x``), if given, receives exactly what ``decode`` of the
        payload returns, computed while encoding instead of by decoding it again."""

    @abc.abstractmethod
    def decode(self, data: bytes | bytearray | memoryview, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``numel`` values (into ``out`` if given, and return it); raises CodecError for a
        mis-sized or invalid payload, after which ``out`` holds garbage."""

    def check(self, data: bytes | bytearray | memoryview, numel: int) -> None:
        """Raise CodecError where ``decode`` would, keeping no values: a payload that passes
        decodes later without error (what a member holds of a round's average until it
        commits). Decoding to a scratch vector here; cheaper where a codec can say so."""
        self.decode(data, numel)


def all_finite(values: torch.Tensor) -> bool:
    """True if no value is NaN or Inf."""
    # A sum is non-finite whenever a term is, and is far cheaper than an
    # elementwise check; only a sum that overflows needs the exact check.
    return bool(torch.isfinite(values.sum(dtype=torch.float32))) or bool(torch.isfinite(values).all())


class FloatCodec(Codec):
    """Each value cast to a float type (round to nearest even); fp16 saturates at ±65504."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.exact = dtype == torch.float32
        self.itemsize = torch.empty(0, dtype=dtype).element_size()

    def wire_bytes(self, numel: int) -> int:
        return numel * self.itemsize

    def encode(self, x: torch.Tensor, decoded: torch.Tensor | None = None) -> bytes:
        _check_input(x)
        if decoded is not None:
            check_vector(decoded, x.numel(), "encode decoded=")
        y = x.to(self.dtype)
        if not all_finite(y):
            if not all_finite(x):
                raise CodecError("non_finite_input")
            # Finite input that overflowed the narrower type: saturate rather
            # than send an Inf that every receiver would have to reject.
            limit = torch.finfo(self.dtype).max
            y = x.clamp(-limit, limit).to(self.dtype)
        if decoded is not None:
            decoded.copy_(y)
        return y.view(torch.uint8).numpy().tobytes()

    def decode(self, data: bytes | bytearray | memoryview, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        raw, private = _payload(self, data, numel)
        if out is not None:
            out = check_vector(out, numel)
            out.copy_(raw.view(self.dtype))
        else:
            out = raw.view(self.dtype).to(torch.float32)
            if out.data_ptr() == raw.data_ptr() and not private:
                out = out.clone()  # never alias a buffer the caller may reuse
        if not all_finite(out):
            raise CodecError("non_finite_value")
        return out

    def check(self, data: bytes | bytearray | memoryview, numel: int) -> None:
        raw, _ = _payload(self, data, numel)
        if not all_finite(raw.view(self.dtype)):  # a cast to fp32 is finite iff its source is
            raise CodecError("non_finite_value")


class BlockCodec(Codec):
    """Blockwise absmax quantization: one fp32 scale per block, then the codes.

    Subclasses set ``base_name`` and ``qmax`` (scale = absmax / qmax) and
    define ``block_bytes(length)`` (code bytes of a block of ``length``
    values), ``_quantize(scaled, scale, decoded)`` (values divided by their
    block's scale, shape (blocks, length) -> code bytes (blocks,
    block_bytes(length)); if ``decoded`` is given, also writes into it what
    the codes decode to, with ``scale`` shaped (blocks, 1)) and
    ``_dequantize(codes, scale, out)`` (writes the values into ``out``, raising
    CodecError for codes no encoder produces). Both compute a value as its
    level times its block's scale, one fp32 multiply, so the two agree bit for bit.
    That torch code is the reference of the C kernels (``p2p/native.py``, kind
    ``base_name``), used where they are built and ``native`` is true.
    """

    base_name: str
    qmax: float

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, chunk_elems: int = CHUNK_ELEMS,
                 native: bool = True) -> None:
        if block_size < 2 or block_size % 2:
            raise ValueError(f"block_size must be an even number >= 2, got {block_size}")
        self.block_size = self.align = block_size
        self.name = self.base_name if block_size == DEFAULT_BLOCK_SIZE else f"{self.base_name}-b{block_size}"
        self.chunk_blocks = max(1, chunk_elems // block_size)  # speed only: the bytes do not depend on it
        # Encode and decode with the C kernels (p2p/native.py) where they can be built; the torch
        # code below is the reference they are tested against, and the fallback.
        self.native = native

    def kernels(self) -> native_kernels.CodecKernels | None:
        return native_kernels.kernels() if self.native else None

    def wire_bytes(self, numel: int) -> int:
        full, rest = divmod(numel, self.block_size)
        return 4 * -(-numel // self.block_size) + full * self.block_bytes(self.block_size) + self.block_bytes(rest)

    def _pieces(self, numel: int):
        """(first element, blocks, block length) per step: runs of whole blocks, then the short last block."""
        full = numel // self.block_size * self.block_size
        step = self.chunk_blocks * self.block_size
        for start in range(0, full, step):
            yield start, min(step, full - start) // self.block_size, self.block_size
        if numel > full:
            yield full, 1, numel - full

    def encode(self, x: torch.Tensor, decoded: torch.Tensor | None = None) -> bytes:
        _check_input(x)
        if decoded is not None:
            check_vector(decoded, x.numel(), "encode decoded=")
        out = torch.empty(self.wire_bytes(x.numel()), dtype=torch.uint8)
        kernels = self.kernels()
        if kernels is None:
            self._encode_reference(x, out, decoded)
        elif reason := kernels.encode(self.base_name, x, self.block_size, out, decoded):
            raise CodecError(reason)
        return out.numpy().tobytes()

    def _encode_reference(self, x: torch.Tensor, out: torch.Tensor, decoded: torch.Tensor | None) -> None:
        """``encode`` in torch ops, chunk by chunk: the payload into ``out``, its values into ``decoded``."""
        numel, nblocks = x.numel(), -(-x.numel() // self.block_size)
        scales, codes = out[: 4 * nblocks].view(torch.float32), out[4 * nblocks :]
        for start, count, length in self._pieces(numel):
            blocks = x[start : start + count * length].view(count, length)
            absmax = blocks.abs().amax(dim=1)  # NaN propagates, so this also checks the values
            if not torch.isfinite(absmax).all():
                raise CodecError("non_finite_input")
            scale = (absmax / self.qmax).clamp_(max=SCALE_LIMIT)
            first = start // self.block_size
            scales[first : first + count] = scale
            # An all-zero block has scale 0; dividing by 1 keeps its codes 0.
            values = None if decoded is None else decoded[start : start + count * length].view(count, length)
            packed = self._quantize(blocks / torch.where(scale > 0, scale, 1.0).unsqueeze(1), scale.unsqueeze(1), values)
            offset = first * self.block_bytes(self.block_size)
            codes[offset : offset + packed.numel()] = packed.view(-1)

    def _split(self, data: bytes | bytearray | memoryview, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A payload's scales (checked) and code bytes."""
        raw, _ = _payload(self, data, numel)
        nblocks = -(-numel // self.block_size)
        scales, codes = raw[: 4 * nblocks].view(torch.float32), raw[4 * nblocks :]
        if not torch.isfinite(scales).all():
            raise CodecError("non_finite_scale")
        if (scales < 0).any():
            raise CodecError("negative_scale")
        if (scales > SCALE_LIMIT).any():
            raise CodecError("scale_overflow")
        return scales, codes

    def decode(self, data: bytes | bytearray | memoryview, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        kernels = self.kernels()
        if kernels is None:
            return self._decode_reference(data, numel, out)
        raw, _ = _payload(self, data, numel)
        out = torch.empty(numel, dtype=torch.float32) if out is None else check_vector(out, numel)
        if reason := kernels.decode(self.base_name, raw, numel, self.block_size, out):
            raise CodecError(reason)
        return out

    def _decode_reference(self, data: bytes | bytearray | memoryview, numel: int, out: torch.Tensor | None) -> torch.Tensor:
        """``decode`` in torch ops, chunk by chunk."""
        scales, codes = self._split(data, numel)
        out = torch.empty(numel, dtype=torch.float32) if out is None else check_vector(out, numel)
        for start, count, length in self._pieces(numel):
            first = start // self.block_size
            offset = first * self.block_bytes(self.block_size)
            part = codes[offset : offset + count * self.block_bytes(length)].view(count, -1)
            self._dequantize(part, scales[first : first + count], out[start : start + count * length].view(count, length))
        return out


class Int8Codec(BlockCodec):
    """Symmetric int8, round to nearest even: |error| <= scale / 2 per block."""

    base_name, qmax = "int8", 127.0

    def block_bytes(self, length: int) -> int:
        return length

    def _quantize(self, scaled: torch.Tensor, scale: torch.Tensor, decoded: torch.Tensor | None) -> torch.Tensor:
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
        if decoded is not None:
            torch.mul(codes, scale, out=decoded)  # as _dequantize does (a level rounded to -0 is code 0: +0)
        return codes.view(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        self._check_codes(codes)
        torch.mul(codes.view(torch.int8), scale.unsqueeze(1), out=out)

    @staticmethod
    def _check_codes(codes: torch.Tensor) -> None:
        if codes.numel() and int(codes.view(torch.int8).min()) == -128:  # outside the symmetric grid
            raise CodecError("bad_code", "int8 code -128")

    def check(self, data: bytes | bytearray | memoryview, numel: int) -> None:
        # Valid scales and codes decode to finite values: |level| <= 127, scale <= SCALE_LIMIT.
        self._check_codes(self._split(data, numel)[1])


class Nibble4Codec(BlockCodec):
    """Two 4-bit codes per byte, code = 8 + level for a level in -7..7 (code 0 is invalid).

    In a block of ``length`` values, ``h = ceil(length / 2)``: byte ``j`` holds
    value ``j`` in its low nibble and value ``j + h`` in its high nibble (the
    two halves of a block pack with contiguous, vectorised reads). A block of
    odd length ends with a pad nibble that must be 8.
    """

    # Subclasses give values16 (float32[16]: the unscaled value of each code,
    # NaN for code 0) and _codes(scaled, scale, decoded) (the code of each
    # value, as float32 or uint8; and, into ``decoded`` if given, values16 of
    # that code times the scale).
    values16: torch.Tensor

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, chunk_elems: int = CHUNK_ELEMS,
                 native: bool = True) -> None:
        super().__init__(block_size, chunk_elems=chunk_elems, native=native)
        byte = torch.arange(256)
        # The value of each possible byte's low and high nibble: decoding a
        # block's two halves is one gather each, written contiguously.
        self.low_values, self.high_values = self.values16[byte & 15], self.values16[byte >> 4]

    def block_bytes(self, length: int) -> int:
        return (length + 1) // 2

    def _quantize(self, scaled: torch.Tensor, scale: torch.Tensor, decoded: torch.Tensor | None) -> torch.Tensor:
        codes = self._codes(scaled, scale, decoded)
        half = self.block_bytes(codes.shape[1])
        if codes.shape[1] % 2:
            codes = torch.cat([codes, codes.new_full((codes.shape[0], 1), 8.0)], dim=1)
        return torch.add(codes[:, :half], codes[:, half:], alpha=16).to(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        count, half = codes.shape
        length = out.shape[1]
        if length % 2 and int(codes[-1, -1]) >> 4 != 8:
            raise CodecError("bad_padding", "pad nibble is not 8")
        index, scale = codes.reshape(-1).to(torch.int32), scale.view(-1, 1)
        torch.mul(self.low_values.index_select(0, index).view(count, half), scale, out=out[:, :half])
        high = self.high_values.index_select(0, index).view(count, half)
        torch.mul(high[:, : length - half], scale, out=out[:, half:])  # an odd block's pad nibble is dropped
        if not all_finite(out):  # only code 0 decodes to NaN
            raise CodecError("bad_code", "4-bit code 0")


class Int4Codec(Nibble4Codec):
    """Uniform levels -7..7 times absmax / 7, round to nearest even: |error| <= scale / 2."""

    base_name, qmax = "int4", 7.0
    values16 = torch.cat([torch.tensor([float("nan")]), torch.arange(-7.0, 8.0)])

    def _codes(self, scaled: torch.Tensor, scale: torch.Tensor, decoded: torch.Tensor | None) -> torch.Tensor:
        codes = scaled.round_().clamp_(-7, 7).add_(8)
        if decoded is not None:  # values16[code] * scale, as _dequantize does (a level rounded to -0 is code 8: +0)
            torch.sub(codes, 8, out=decoded).mul_(scale)
        return codes


class FP4Codec(Nibble4Codec):
    """FP4 E3M0: level ±e is ±2^(e-7) * absmax, level 0 is 0; |error| <= max(|x| / 3, absmax / 128)."""

    base_name, qmax = "fp4", 1.0
    _levels = torch.arange(-7.0, 8.0)
    values16 = torch.cat([torch.tensor([float("nan")]), _levels.sign() * torch.ldexp(torch.ones(15), _levels.abs().int() - 7)])

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, chunk_elems: int = CHUNK_ELEMS,
                 native: bool = True) -> None:
        super().__init__(block_size, chunk_elems=chunk_elems, native=native)
        # The code of a scaled value (|v| <= 1) depends only on its sign, its
        # exponent and its first mantissa bit: the top 10 bits of its fp32
        # pattern. The nearest power of two is 2^(exponent + bit) (the bit is
        # set exactly from 1.5 * 2^k up, the midpoint to 2^(k+1)), i.e. level
        # exponent + bit - 120, clamped to 0..7; from 2^-7 (the midpoint
        # between 0 and 2^-6) up the level is at least 1. So encoding is one
        # table look-up per value instead of a dozen elementwise passes.
        top = torch.arange(1024)
        sign, exponent, bit = top >> 9, (top >> 1) & 0xFF, top & 1
        level = (exponent + bit - 120).clamp(0, 7)
        level = torch.where(exponent >= 120, level.clamp(min=1), level)
        self.code_table = torch.where(sign == 1, 8 - level, 8 + level).to(torch.uint8)
        self.value_table = self.values16[self.code_table.long()]  # the unscaled value each top bits encode to

    def _codes(self, scaled: torch.Tensor, scale: torch.Tensor, decoded: torch.Tensor | None) -> torch.Tensor:
        top = scaled.view(torch.int32).bitwise_right_shift(22).bitwise_and_(0x3FF).view(-1)
        if decoded is not None:
            torch.mul(self.value_table.index_select(0, top).view(scaled.shape), scale, out=decoded)
        return self.code_table.index_select(0, top).view(scaled.shape)


_ALL = (FloatCodec("fp32", torch.float32), FloatCodec("fp16", torch.float16), FloatCodec("bf16", torch.bfloat16),
        Int8Codec(), Int4Codec(), FP4Codec())
CODECS: dict[str, Codec] = {codec.name: codec for codec in _ALL}


def get_codec(name: str) -> Codec:
    """The registered codec called ``name``; ValueError naming the choices otherwise."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"swarm.codec: unknown codec {name!r} (choose from {', '.join(CODECS)})") from None


class ErrorFeedback:
    """Keeps what a lossy codec dropped from one flat vector and adds it back next round.

    Per round: ``sent = compensate(x)``, transmit ``encode(sent)``, then
    ``update(sent, decode(encode(sent)))``; or all three at once with ``encode``.
    """

    def __init__(self, numel: int) -> None:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        self.residual = torch.zeros(numel, dtype=torch.float32)
        # True while ``residual`` holds a round's compensated contribution (``fold``) rather than
        # a residual: from the fold until that round commits (``settle``).
        self.holding = False
        self.restarts = 0  # folds that found the last round's vector never settled (``fold``)

    def fold(self, x: torch.Tensor) -> None:
        """Add the residual into ``x`` (a round's own vector, consumed), which becomes the
        residual's storage: the round writes the next residual over it in place, and the old
        vector's memory is given back. ``holding`` until the round commits. ``x`` may be the
        residual's vector itself, the pseudo-gradient added into it already (``target``): then
        no second vector exists at all."""
        if x is self.residual:
            if self.holding:
                raise ValueError("this vector is a round's already: give the next round a vector of its own")
            self.holding = True  # the pseudo-gradient was added into it (``pseudo_gradient(into=)``)
            return
        if x.shape != self.residual.shape or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"error feedback holds {self.residual.numel()} fp32 values, got {x.dtype} {tuple(x.shape)}")
        if self.holding:
            # The round that took the last vector never committed (the swarm moved past it, or it
            # was given up): that vector holds a pseudo-gradient nobody will apply, not only what a
            # codec dropped. Nothing is added back; what earlier rounds dropped is lost with it.
            self.restarts += 1
        else:
            x.add_(self.residual)
        self.residual, self.holding = x, True

    @property
    def target(self) -> torch.Tensor | None:
        """The vector to add the next pseudo-gradient into (the residual's, once its round
        committed), so that it holds the compensated contribution without a vector of Δ
        alone; None while a round holds it."""
        return None if self.holding else self.residual

    def settle(self) -> None:
        """The round that holds the residual's vector committed: it holds the next residual."""
        self.holding = False

    def compensate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the residual left by earlier rounds (a new tensor)."""
        if x.shape != self.residual.shape:
            raise ValueError(f"error feedback holds {self.residual.numel()} values, got shape {tuple(x.shape)}")
        return x + self.residual

    def update(self, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Remember what the receivers did not get: ``compensated - transmitted``."""
        torch.sub(compensated, transmitted, out=self.residual)

    def adopt(self, residual: torch.Tensor) -> torch.Tensor:
        """Take ``residual`` (``compensated - transmitted``, computed elsewhere, e.g. piece by piece
        during a round) as the new residual; returns the old one, whose buffer the caller may reuse."""
        if residual.shape != self.residual.shape or residual.dtype != torch.float32:
            raise ValueError(f"error feedback holds {self.residual.numel()} fp32 values, got {residual.dtype} "
                             f"{tuple(residual.shape)}")
        old, self.residual = self.residual, residual
        return old

    def encode(self, codec: Codec, x: torch.Tensor) -> bytes:
        """Compensate ``x``, encode it, and keep the new residual; returns the payload."""
        compensated = self.compensate(x)
        transmitted = torch.empty_like(compensated)
        payload = codec.encode(compensated, transmitted)  # raises before the residual changes
        self.update(compensated, transmitted)
        return payload

    def reset(self) -> None:
        self.residual.zero_()

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """None while a round holds the vector (``holding``: a pseudo-gradient is in it, not only
        what a codec dropped): a checkpoint then keeps no residual, and feedback starts over."""
        return None if self.holding else {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict) -> None:
        residual = state.get("residual") if isinstance(state, dict) else None
        if not isinstance(residual, torch.Tensor) or residual.dim() != 1 or not residual.is_floating_point():
            raise ValueError("error feedback state needs a 1-D float tensor 'residual'")
        if residual.numel() != self.residual.numel():
            raise ValueError(f"error feedback residual has {residual.numel()} values, expected {self.residual.numel()}")
        if not torch.isfinite(residual).all():
            raise ValueError("error feedback residual holds non-finite values")
        self.residual = residual.detach().to(device="cpu", dtype=torch.float32).clone()
        self.holding = False
