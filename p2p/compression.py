"""Where a codec touches the all-reduce: the two quantisation points of a round.

1. A member encodes its (error-compensated) pseudo-gradient once per part of the
   butterfly: ``encode_parts``. What the receivers will decode (``sent``) is
   what error feedback subtracts to keep the residual.
2. The owner of a part averages the decoded contributions in member order and
   encodes the average once: ``average_part``. Every member decodes those same
   bytes, so all end bit-identical.

The swarm (``p2p/group.py``) streams each part as *pieces* (``piece_bounds``),
runs of whole codec blocks encoded one at a time so that averaged pieces can
travel back while later ones are still arriving. A codec's blocks never
straddle a piece boundary, so a part encoded piece by piece decodes to exactly
the values of the part encoded at once: the simulator (``CompressingMember``)
encodes whole parts and still sees the swarm's numbers, so compressed
convergence measured in-process is the swarm's.
"""

from __future__ import annotations

import math

import torch

from p2p.codecs import Codec, ErrorFeedback, check_vector


def part_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, numel) into ``parts`` contiguous ranges of near-equal size."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def piece_bounds(start: int, end: int, codec: Codec, piece_elems: int) -> list[tuple[int, int]]:
    """Split the part [start, end) into pieces of ``piece_elems`` values, rounded down to whole codec
    blocks (at least one block); the last piece takes the rest. An empty part has no pieces."""
    step = max(codec.align, piece_elems // codec.align * codec.align)
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def encode_parts(codec: Codec, flat: torch.Tensor, bounds: list[tuple[int, int]]) -> tuple[list[bytes], torch.Tensor]:
    """One payload per part, and the values the receivers will decode from them."""
    payloads, sent = [], torch.empty_like(flat)
    for start, end in bounds:
        payloads.append(codec.encode(flat[start:end].contiguous(), sent[start:end]))
    return payloads, sent


def average_part(codec: Codec, contributions: list[tuple[float, torch.Tensor]]) -> bytes:
    """Token-weighted mean of one part's (or piece's) contributions, in the order given, encoded once.

    Elementwise, so the mean of a piece is that piece of the part's mean. Each product is
    rounded before it is added (``add_(x, alpha=a)`` fuses the two in torch's vectorized CPU
    kernels only), so the bytes do not depend on the owner's CPU."""
    total = math.fsum(w for w, _ in contributions)
    (w0, first), rest = contributions[0], contributions[1:]
    acc = torch.mul(first, w0 / total)
    term = torch.empty_like(acc) if rest else None
    for w, part in rest:
        acc.add_(torch.mul(part, w / total, out=term))
    return codec.encode(acc)


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None,
            plus: torch.Tensor | None = None) -> torch.Tensor:
    """All values of ``tensors`` as one fp32 CPU vector, into ``out`` if given (each tensor copied
    once, whatever its device and type), plus the vector ``plus`` if given (added while copying:
    error feedback's residual costs no extra pass over the vector)."""
    numel = sum(t.numel() for t in tensors)
    if plus is not None:
        check_vector(plus, numel, "flatten plus=")
    out = torch.empty(numel, dtype=torch.float32) if out is None else check_vector(out, numel, "flatten out=")
    offset = 0
    for t in tensors:
        dest, values = out[offset : offset + t.numel()], t.detach().reshape(-1)
        if plus is None:
            dest.copy_(values)
        else:
            torch.add(values.to("cpu", torch.float32), plus[offset : offset + t.numel()], out=dest)
        offset += t.numel()
    return out


def unflatten(flat: torch.Tensor, like: list[torch.Tensor], *, copy: bool = True) -> list[torch.Tensor]:
    """``flat`` cut into tensors shaped like ``like``; ``copy=False`` returns views of ``flat``
    (for a buffer nobody else writes to, such as a round's fresh result)."""
    out, offset = [], 0
    for t in like:
        view = flat[offset : offset + t.numel()].view_as(t)
        out.append(view.clone() if copy else view)
        offset += t.numel()
    return out


class CompressingMember:
    """Simulator averager: what the swarm's codec does to one member's round, around an
    exact in-process average of the k members (``trainer.averaging.InProcessGroup``)."""

    def __init__(self, inner, codec: Codec, members: int, *, feedback: bool = True) -> None:
        self.inner = inner
        self.codec = codec
        self.members = members
        self.feedback = feedback
        self._ef: ErrorFeedback | None = None

    async def average(self, tensors: list[torch.Tensor], weight: float, round: int) -> list[torch.Tensor] | None:
        flat = flatten(tensors)
        if self.feedback and self._ef is None:
            self._ef = ErrorFeedback(flat.numel())
        compensated = self._ef.compensate(flat) if self._ef is not None else flat
        bounds = part_bounds(flat.numel(), self.members)
        _, sent = encode_parts(self.codec, compensated, bounds)
        averaged = await self.inner.average(unflatten(sent, tensors), weight, round)
        if averaged is None:
            return None
        if self._ef is not None:
            self._ef.update(compensated, sent)
        # The owners' re-encoding of each averaged part, decoded by everyone.
        _, received = encode_parts(self.codec, flatten(averaged), bounds)
        return unflatten(received, tensors)
