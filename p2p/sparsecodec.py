"""The sparse codec: in each chunk of values, the largest few, their values in a few bits.

SparseLoCo (arXiv 2508.15706) sends, of each chunk of the error-compensated
pseudo-gradient, only the ``k`` values of largest magnitude, quantized to 2 bits;
error feedback carries everything else into the next round. With 64 of 4096 values
at 2 bits and 12-bit indices a chunk is 120 bytes instead of 16384 (136x fewer than
fp32). Names and settings: p2p/sparsename.py.

Wire format of ``numel`` values (little-endian, no header: the size follows from
``numel``, as for every codec, p2p/codecs.py). The vector is cut into chunks of
``chunk`` values (the last may be shorter, ``L`` values); a chunk of ``L`` values
keeps ``kept(L) = min(L, ceil(k * L / chunk))`` (``k`` for a whole chunk).

1. Per chunk, two fp32: ``lo`` and ``step`` (finite, >= 0, each <= 2^120).
2. The index stream: every kept value's index within its chunk, ``log2(chunk)``
   bits each, chunk after chunk; within a chunk strictly increasing and below the
   chunk's length. Bits are packed least significant first: entry ``i`` holds bits
   ``[i*w, (i+1)*w)`` of the stream, bit ``j`` of the stream is bit ``j % 8`` of
   byte ``j // 8``. The stream is padded with zero bits to a whole byte.
3. The code stream: one ``bits``-bit code per kept value in the same order, packed
   the same way. A code's top bit is the sign (1: negative), the others its level
   ``m`` in 0..M, ``M = 2^(bits-1) - 1``. The value is ``±(lo + m * step)``, one fp32
   multiply and one fp32 add; every other value of the chunk is 0.

The encoder keeps the ``kept(L)`` values of largest magnitude (ties: the lower index),
sets ``lo`` and ``lo + M * step`` to the smallest and largest kept magnitude and rounds
each kept magnitude to the nearest level (ties to even). A sparse codec also names the
format of the averaged part (``average``): the owner of a part keeps ``ak`` values per
chunk of the members' average at ``ab`` bits, so a member downloads as little as it
uploads; what the average drops goes back to the members' error feedback
(``kept``; docs/compression.md, "Sparse").

Decoding refuses, with a ``CodecError`` reason: a payload of the wrong size
(``bad_size``), a non-finite, negative or too large ``lo``/``step``
(``non_finite_scale``, ``negative_scale``, ``scale_overflow``), an index out of its
chunk or not above the one before it, duplicates included (``bad_index``), and
non-zero padding bits (``bad_padding``). Every accepted payload decodes to finite
values of magnitude at most 2^127. Where a payload has several of these faults the first
in this order is named: a scale (any chunk's), the index stream's padding, the code
stream's padding, an index (any chunk's).

The codec encodes and decodes with C kernels (``p2p/nibble.c``, loaded by
``p2p/native.py``) where they can be built; the torch code here is their reference and
fallback, and gives the same bytes, the same values and the same reasons.
"""

from __future__ import annotations

import torch

from p2p import native as native_kernels
from p2p import sparsename
# SCALE_LIMIT is the largest legal lo and step: lo + 127 * step is at most 2^127, below fp32's limit.
from p2p.codec import (SCALE_LIMIT, Codec, CodecError, all_finite, check_input, check_scales, check_vector,
                       checked_payload)
# Chunks per step of the torch code: bounds its temporaries.
STEP_CHUNKS = 256


def _pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` (non-negative, < 2^width) as a bit stream of ``width`` bits each, least
    significant first, zero-padded to whole bytes."""
    bits = ((values.to(torch.int64).unsqueeze(1) >> torch.arange(width)) & 1).to(torch.uint8).reshape(-1)
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32)).sum(1).to(torch.uint8)


def _unpack(stream: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """``count`` entries of ``width`` bits from a packed stream (int64); padding must be zero."""
    bits = ((stream.to(torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1).reshape(-1)
    if bits[count * width:].any():
        raise CodecError("bad_padding", "non-zero padding bits")
    return (bits[: count * width].view(count, width).to(torch.int64) << torch.arange(width)).sum(1)


class SparseCodec(Codec):
    """Chunked top-k with ``bits``-bit values and ``log2(chunk)``-bit indices (see the module)."""

    # Pieces of 2^22 values: 120 KB of input and 264 KB of average by default, as large on the
    # wire as a 4-bit codec's pieces of 2^18 (a piece's fixed costs, framing and a hop to the
    # worker thread, stay small beside its bytes).
    piece_factor = 16

    def __init__(self, chunk: int = 4096, keep: int = 64, bits: int = 2, average_keep: int = 0,
                 average_bits: int = 4, *, native: bool = True, _average: bool = False) -> None:
        """``average_keep`` 0: twice ``keep``, at most the chunk (p2p/sparsename.py)."""
        average_keep = average_keep or min(2 * keep, chunk)
        settings = {"c": chunk, "k": keep, "b": bits, "ak": average_keep, "ab": average_bits}
        name = sparsename.canonical(settings)
        if sparsename.parse(name) != settings:  # raises ValueError for invalid settings
            raise ValueError(f"invalid sparse codec settings {settings}")
        self.chunk = self.align = chunk
        self.keep, self.bits = keep, bits
        self.index_bits = chunk.bit_length() - 1
        self.levels = (1 << (bits - 1)) - 1  # M: the largest level
        # Encode and decode with the C kernels (p2p/native.py) where they can be built; the torch
        # code below is the reference they are tested against, and the fallback.
        self.native = native
        self.name = name
        self._average = self
        if not _average:
            # The averaged part's format, named after the swarm's codec, which fixes it.
            self._average = SparseCodec(chunk, average_keep, average_bits, average_keep, average_bits,
                                        native=native, _average=True)
            self._average.name = f"{name}/average"

    @property
    def average(self) -> SparseCodec:
        return self._average

    @classmethod
    def from_name(cls, name: str) -> SparseCodec:
        s = sparsename.parse(name)
        if s is None:
            raise ValueError(f"not a sparse codec name: {name!r}")
        return cls(s["c"], s["k"], s["b"], s["ak"], s["ab"])

    # ---- sizes ---------------------------------------------------------------------

    def kept(self, length: int) -> int:
        """Values kept of a chunk of ``length`` values."""
        return min(length, -(-self.keep * length // self.chunk))

    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """(chunks, kept values, index stream bytes, code stream bytes) of ``numel`` values."""
        full, rest = divmod(numel, self.chunk)
        chunks, count = full + (1 if rest else 0), full * self.keep + (self.kept(rest) if rest else 0)
        return chunks, count, -(-count * self.index_bits // 8), -(-count * self.bits // 8)

    def wire_bytes(self, numel: int) -> int:
        chunks, _, index_bytes, code_bytes = self._layout(numel)
        return 8 * chunks + index_bytes + code_bytes

    def _rows(self, numel: int):
        """(first value, chunks, chunk length) per step: runs of whole chunks, then the short last one."""
        full = numel // self.chunk * self.chunk
        step = STEP_CHUNKS * self.chunk
        for start in range(0, full, step):
            yield start, min(step, full - start) // self.chunk, self.chunk
        if numel > full:
            yield full, 1, numel - full

    def kernels(self) -> native_kernels.CodecKernels | None:
        """The C kernels (built or loaded on the first call: the node calls this at start), or None."""
        return native_kernels.kernels() if self.native else None

    # ---- encode --------------------------------------------------------------------

    def encode(self, x: torch.Tensor, decoded: torch.Tensor | None = None) -> bytes:
        check_input(x)
        if decoded is not None:
            check_vector(decoded, x.numel(), "encode decoded=")
        kernels = self.kernels()
        if kernels is None:
            return self._encode_reference(x, decoded)
        out = torch.empty(self.wire_bytes(x.numel()), dtype=torch.uint8)
        if reason := kernels.sparse_encode(x, self.chunk, self.keep, self.bits, out, decoded):
            raise CodecError(reason)
        return out.numpy().tobytes()

    def _encode_reference(self, x: torch.Tensor, decoded: torch.Tensor | None) -> bytes:
        """``encode`` in torch ops, a few chunks at a time."""
        if not all_finite(x):
            raise CodecError("non_finite_input")
        numel = x.numel()
        chunks, count, index_bytes, code_bytes = self._layout(numel)
        scales = torch.empty(2 * chunks, dtype=torch.float32)
        indices = torch.empty(count, dtype=torch.int64)
        codes = torch.empty(count, dtype=torch.int64)
        if decoded is not None:
            decoded.zero_()
        chunk_at = kept_at = 0
        for start, rows, length in self._rows(numel):
            kept = self.kept(length)
            block = x[start : start + rows * length].view(rows, length)
            index, lo, step, code, values = self._encode_rows(block, kept)
            scales[2 * chunk_at : 2 * (chunk_at + rows)] = torch.stack([lo, step], dim=1).reshape(-1)
            indices[kept_at : kept_at + rows * kept] = index.reshape(-1)
            codes[kept_at : kept_at + rows * kept] = code.reshape(-1)
            if decoded is not None:
                decoded[start : start + rows * length].view(rows, length).scatter_(1, index, values)
            chunk_at, kept_at = chunk_at + rows, kept_at + rows * kept
        return b"".join([scales.view(torch.uint8).numpy().tobytes(),
                         _pack(indices, self.index_bits).numpy().tobytes(),
                         _pack(codes, self.bits).numpy().tobytes()])

    def _encode_rows(self, block: torch.Tensor, kept: int):
        """Top ``kept`` of each row: (indices ascending, lo, step, codes, decoded values)."""
        length = block.shape[1]
        magnitude = block.abs()
        # A unique key per value: larger magnitude first, then the lower index (the fp32 bits of a
        # non-negative float order like the float).
        key = (magnitude.view(torch.int32).to(torch.int64) << 16) | (65535 - torch.arange(length))
        index = (65535 - (key.topk(kept, dim=1, sorted=False).values & 0xFFFF)).sort(dim=1).values
        values = block.gather(1, index)
        kept_magnitude = values.abs().clamp_(max=SCALE_LIMIT)  # beyond the limit: the limit (a legal payload)
        lo = kept_magnitude.amin(dim=1)
        step = (kept_magnitude.amax(dim=1) - lo) / torch.full_like(lo, float(self.levels))
        spread = step.unsqueeze(1)
        level = torch.where(spread > 0, ((kept_magnitude - lo.unsqueeze(1)) / torch.where(spread > 0, spread, 1.0)),
                            0.0).round_().clamp_(0, self.levels)
        negative = values < 0
        code = level.to(torch.int64) | (negative.to(torch.int64) << (self.bits - 1))
        return index, lo, step, code, self._values(lo, step, level, negative)

    @staticmethod
    def _values(lo: torch.Tensor, step: torch.Tensor, level: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        """±(lo + m * step) per row, one rounding per op (as the decoder)."""
        magnitude = torch.mul(level.to(torch.float32), step.unsqueeze(1)).add_(lo.unsqueeze(1))
        return torch.where(negative, magnitude.neg(), magnitude)

    # ---- decode --------------------------------------------------------------------

    def _parse(self, data, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A payload's (lo/step per chunk, indices, codes), every field checked."""
        raw, _ = checked_payload(self, data, numel)
        chunks, count, index_bytes, _ = self._layout(numel)
        scales = raw[: 8 * chunks].view(torch.float32)
        check_scales(scales)
        indices = _unpack(raw[8 * chunks : 8 * chunks + index_bytes], count, self.index_bits)
        codes = _unpack(raw[8 * chunks + index_bytes :], count, self.bits)
        at = 0
        for start, rows, length in self._rows(numel):
            kept = self.kept(length)
            index = indices[at : at + rows * kept].view(rows, kept)
            if int(index[:, -1].max()) >= length or (kept > 1 and not bool((index[:, 1:] > index[:, :-1]).all())):
                raise CodecError("bad_index", "indices must increase within their chunk")
            at += rows * kept
        return scales.view(chunks, 2), indices, codes

    def _decode_native(self, kernels: native_kernels.CodecKernels, raw: torch.Tensor, numel: int,
                       out: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
        """``_parse``'s checks of a payload of the right size by the kernel, decoding into ``out``
        and marking ``mask`` where given."""
        if reason := kernels.sparse_decode(raw, numel, self.chunk, self.keep, self.bits, out, mask):
            raise CodecError(reason)

    def decode(self, data, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        kernels = self.kernels()
        if kernels is None:
            return self._decode_reference(data, numel, out)
        raw, _ = checked_payload(self, data, numel)
        out = torch.empty(numel, dtype=torch.float32) if out is None else check_vector(out, numel)
        self._decode_native(kernels, raw, numel, out=out)
        return out

    def _decode_reference(self, data, numel: int, out: torch.Tensor | None) -> torch.Tensor:
        """``decode`` in torch ops, a few chunks at a time."""
        scales, indices, codes = self._parse(data, numel)
        out = torch.empty(numel, dtype=torch.float32) if out is None else check_vector(out, numel)
        out.zero_()
        chunk_at = kept_at = 0
        for start, rows, length in self._rows(numel):
            kept = self.kept(length)
            index = indices[kept_at : kept_at + rows * kept].view(rows, kept)
            code = codes[kept_at : kept_at + rows * kept].view(rows, kept)
            lo, step = scales[chunk_at : chunk_at + rows, 0], scales[chunk_at : chunk_at + rows, 1]
            values = self._values(lo, step, code & self.levels, (code >> (self.bits - 1)).bool())
            out[start : start + rows * length].view(rows, length).scatter_(1, index, values)
            chunk_at, kept_at = chunk_at + rows, kept_at + rows * kept
        return out

    def check(self, data, numel: int) -> None:
        kernels = self.kernels()
        if kernels is None:
            self._parse(data, numel)  # every accepted field decodes to a finite value
        else:
            self._decode_native(kernels, checked_payload(self, data, numel)[0], numel)

    def support(self, data, numel: int) -> torch.Tensor:
        """Which of the ``numel`` values a (valid) payload keeps, as a bool vector."""
        kernels = self.kernels()
        if kernels is None:
            return self._support_reference(data, numel)
        raw, _ = checked_payload(self, data, numel)
        mask = torch.empty(numel, dtype=torch.bool)
        self._decode_native(kernels, raw, numel, mask=mask)
        return mask

    def _support_reference(self, data, numel: int) -> torch.Tensor:
        """``support`` in torch ops."""
        _, indices, _ = self._parse(data, numel)
        mask = torch.zeros(numel, dtype=torch.bool)
        kept_at = 0
        for start, rows, length in self._rows(numel):
            kept = self.kept(length)
            index = indices[kept_at : kept_at + rows * kept].view(rows, kept)
            mask[start : start + rows * length].view(rows, length).scatter_(1, index, True)
            kept_at += rows * kept
        return mask
