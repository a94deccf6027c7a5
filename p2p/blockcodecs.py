"""Blockwise absmax codecs: int8, int4 and fp4, one fp32 scale per block of values.

Wire formats (little-endian, no header, as every codec: p2p/codecs.py):

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

They encode and decode with C kernels (``p2p/nibble.c``, loaded by
``p2p/native.py``) where they can be built; the torch code here is their
reference and fallback, and gives the same bytes and the same values.
"""

from __future__ import annotations

import torch

from p2p import native as native_kernels
from p2p.codec import (SCALE_LIMIT, Codec, CodecError, all_finite, check_input, check_scales, check_vector,
                       checked_payload)

DEFAULT_BLOCK_SIZE = 256
# Elements per encode/decode step: bounds the temporaries (a few times 16 MB)
# while keeping the number of torch ops small. Measured on 2 shared cores:
# when training competes for the cores each op pays a scheduling delay, and
# 2^18-element steps made encoding ~10x slower than 2^22.
CHUNK_ELEMS = 1 << 22


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
        check_input(x)
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
        raw, _ = checked_payload(self, data, numel)
        nblocks = -(-numel // self.block_size)
        scales, codes = raw[: 4 * nblocks].view(torch.float32), raw[4 * nblocks :]
        check_scales(scales)
        return scales, codes

    def decode(self, data: bytes | bytearray | memoryview, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        kernels = self.kernels()
        if kernels is None:
            return self._decode_reference(data, numel, out)
        raw, _ = checked_payload(self, data, numel)
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
