"""The codec interface: what a wire codec of pseudo-gradients promises, and the checks every one shares.

A codec turns a flat fp32 vector into bytes and back (the formats: p2p/codecs.py,
p2p/blockcodecs.py). Two properties matter more than speed:

- Decoding is a pure function of the bytes: table look-ups and IEEE fp32
  multiplies, no randomness, so every member that decodes the averaged part
  ends with bit-identical values.
- A payload from another peer is untrusted. ``decode`` checks its exact size
  and every field a hostile peer could poison (scales, padding, codes,
  non-finite values) and raises ``CodecError`` with a metric ``reason``
  instead of returning anything that could reach the model.
"""

from __future__ import annotations

import abc
import sys

import torch

if sys.byteorder != "little":  # payloads are the in-memory bytes of torch tensors
    raise ImportError("p2p.codec assumes a little-endian host")


class CodecError(ValueError):
    """A payload (or input) a codec refuses; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def check_input(x: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` is what every codec encodes."""
    if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"codec input must be a 1-D contiguous float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")


def check_vector(out: torch.Tensor, numel: int, what: str = "decode out=") -> torch.Tensor:
    """``out`` if it is a contiguous fp32 CPU vector of ``numel`` values; ValueError naming ``what`` otherwise."""
    if out.dtype != torch.float32 or out.shape != (numel,) or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"{what} must be a contiguous float32 CPU tensor of shape ({numel},), "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def checked_payload(codec: Codec, data: bytes | bytearray | memoryview, numel: int) -> tuple[torch.Tensor, bool]:
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
    # A round's pieces hold this many times the base number of values (p2p/group.py PIECE_ELEMS):
    # a codec of few bytes per value streams pieces of a useful size (the sparse codec's 16).
    piece_factor: int = 1

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

    @property
    def average(self) -> Codec:
        """The codec of an owner's averaged part: this one, but for a sparse codec
        (p2p/sparsecodec.py), whose owners keep more values of the average than a member sends."""
        return self

    def support(self, data: bytes | bytearray | memoryview, numel: int) -> torch.Tensor | None:
        """Which values a valid payload carries (a bool vector), or None for all of them: what
        error feedback counts as delivered of a member's input (p2p/contribution.py)."""
        return None

    def check(self, data: bytes | bytearray | memoryview, numel: int) -> None:
        """Raise CodecError where ``decode`` would, keeping no values: a payload that passes
        decodes later without error (what a member holds of a round's average until it
        commits). Decoding to a scratch vector here; cheaper where a codec can say so."""
        self.decode(data, numel)


# Largest legal scale of any codec's payload (block scales; the sparse codec's lo and step): a power
# of two far above any pseudo-gradient, and small enough that a scale times the largest level
# (127) stays finite, so a scale a hostile peer picks can never decode to Inf.
SCALE_LIMIT = 2.0**120


def check_scales(scales: torch.Tensor) -> None:
    """Raise CodecError unless every scale of a payload is finite, >= 0 and <= ``SCALE_LIMIT``."""
    if not torch.isfinite(scales).all():
        raise CodecError("non_finite_scale")
    if (scales < 0).any():
        raise CodecError("negative_scale")
    if (scales > SCALE_LIMIT).any():
        raise CodecError("scale_overflow")


def all_finite(values: torch.Tensor) -> bool:
    """True if no value is NaN or Inf."""
    # A sum is non-finite whenever a term is, and is far cheaper than an
    # elementwise check; only a sum that overflows needs the exact check.
    return bool(torch.isfinite(values.sum(dtype=torch.float32))) or bool(torch.isfinite(values).all())
