"""Wire codecs for pseudo-gradients by name: fp32, fp16, bf16, int8, int4, fp4 and sparse.

The butterfly all-reduce sends each part of a flat fp32 vector once per hop;
these codecs shrink those bytes. What every codec promises (decoding is a pure
function of the bytes; an untrusted payload is checked before any value of it
is returned) is the interface in p2p/codec.py; the block codecs int8, int4 and
fp4, with their C kernels, are in p2p/blockcodecs.py; error feedback, which
adds back what a lossy codec dropped, in p2p/feedback.py. This module holds the
float codecs and the registry peers name a codec by (``swarm.codec``).

Wire formats (all little-endian, no header: the receiver knows ``numel`` from
the round, so ``wire_bytes(numel)`` is the exact payload size):

- ``fp32`` / ``fp16`` / ``bf16``: ``numel`` values of that type.
- ``int8``, ``int4``, ``fp4`` (and ``-b<block size>`` variants): see
  p2p/blockcodecs.py.
- ``sparse`` (and its variants, p2p/sparsename.py): chunked top-k with packed
  indices and 2-8-bit values, and a format of its own for the averaged part:
  see p2p/sparsecodec.py.
"""

from __future__ import annotations

import torch

from p2p import sparsename
from p2p.blockcodecs import FP4Codec, Int4Codec, Int8Codec
from p2p.sparsecodec import SparseCodec
from p2p.codec import Codec, CodecError, all_finite, check_input, check_vector, checked_payload

__all__ = ["CODECS", "FloatCodec", "get_codec"]


class FloatCodec(Codec):
    """Each value cast to a float type (round to nearest even); fp16 saturates at ±65504."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.exact = dtype == torch.float32
        self.itemsize = torch.empty(0, dtype=dtype).element_size()

    def wire_bytes(self, numel: int) -> int:
        return numel * self.itemsize

    def encode(self, x: torch.Tensor, decoded: torch.Tensor | None = None) -> bytes:
        check_input(x)
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
        raw, private = checked_payload(self, data, numel)
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
        raw, _ = checked_payload(self, data, numel)
        if not all_finite(raw.view(self.dtype)):  # a cast to fp32 is finite iff its source is
            raise CodecError("non_finite_value")


_ALL = (FloatCodec("fp32", torch.float32), FloatCodec("fp16", torch.float16), FloatCodec("bf16", torch.bfloat16),
        Int8Codec(), Int4Codec(), FP4Codec())
CODECS: dict[str, Codec] = {codec.name: codec for codec in _ALL}
_SPARSE: dict[str, SparseCodec] = {}  # by canonical name, built when first asked for


def get_codec(name: str) -> Codec:
    """The registered codec called ``name``, or the sparse codec a ``sparse...`` name describes
    (p2p/sparsename.py); ValueError naming the choices otherwise."""
    codec = CODECS.get(name)
    if codec is not None:
        return codec
    try:
        settings = sparsename.parse(name)
    except ValueError as e:
        raise ValueError(f"swarm.codec: {e}") from None
    if settings is None:
        raise ValueError(f"swarm.codec: unknown codec {name!r} (choose from {', '.join(CODECS)}, "
                         f"sparse[-c..][-k..][-b..][-ak..][-ab..])") from None
    canonical = sparsename.canonical(settings)
    if canonical not in _SPARSE:
        _SPARSE[canonical] = SparseCodec(settings["c"], settings["k"], settings["b"], settings["ak"], settings["ab"])
    return _SPARSE[canonical]
