"""Where a codec touches the all-reduce: the two quantisation points of a round.

1. A member encodes its (error-compensated) pseudo-gradient once per part of the
   butterfly: ``encode_parts``. What the receivers will decode (``sent``) is
   what error feedback subtracts to keep the residual.
2. The owner of a part combines the decoded contributions in member order with
   the round's aggregator (``p2p/aggregate.py``: the weighted mean or a robust
   one) and encodes the result once: ``average_part``. Every member decodes
   those same bytes, so all end bit-identical.

The swarm (``p2p/group.py``) streams each part as *pieces* (``piece_bounds``),
runs of whole codec blocks encoded one at a time so that averaged pieces can
travel back while later ones are still arriving. A codec's blocks never
straddle a piece boundary, so a part encoded piece by piece decodes to exactly
the values of the part encoded at once: the simulator (``CompressingMember``)
encodes whole parts and still sees the swarm's numbers, so compressed
convergence measured in-process is the swarm's. ``SwarmAverage`` runs the
owners' aggregation for the simulator, on the swarm's parts and pieces (a
robust aggregator's clipping depends on where a piece starts and ends).
"""

from __future__ import annotations

import bisect
import threading
from typing import Sequence

import torch

from p2p.aggregate import aggregate
from p2p.codec import Codec, check_vector
from p2p.codecs import get_codec
from p2p.feedback import ErrorFeedback

# Values per piece of the swarm's all-reduce: the unit a part owner aggregates, encodes and sends.
PIECE_ELEMS = 1 << 18


def part_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, numel) into ``parts`` contiguous ranges of near-equal size."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def owned_bounds(numel: int, owns: list[bool]) -> list[tuple[int, int]]:
    """``part_bounds`` over the members that own a part (``owns``, in member order); the others get
    an empty range at the start of the next owner's part. All own: exactly ``part_bounds``."""
    shares = iter(part_bounds(numel, sum(owns)))
    bounds, at = [], 0
    for owner in owns:
        if owner:
            start, at = next(shares)
            bounds.append((start, at))
        else:
            bounds.append((at, at))
    return bounds


def exchange_bytes(codec: Codec, numel: int, peers: int) -> float:
    """Bytes one peer sends per round in a butterfly of ``peers`` owners (as many again it
    receives), averaged over the peers: its input to the other owners' parts and its own part's
    average (``Codec.average``) to the other members, (peers - 1)/peers of both over the vector."""
    parts = part_bounds(numel, peers)
    return sum(codec.wire_bytes(e - s) + codec.average.wire_bytes(e - s) for s, e in parts) * (peers - 1) / peers


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


def average_part(codec: Codec, contributions: list[tuple[float, torch.Tensor]], aggregator: str = "mean") -> bytes:
    """One part's (or piece's) contributions, (weight, decoded values) in member order, combined by
    ``aggregator`` (``p2p.aggregate``) and encoded once.

    The mean is elementwise, so the mean of a piece is that piece of the part's mean; the robust
    aggregators clip whole pieces, so the swarm and the simulator cut parts into the same pieces.
    No result depends on the owner's CPU (see ``p2p.aggregate``)."""
    return codec.encode(aggregate(aggregator, [w for w, _ in contributions], [t for _, t in contributions]))


class SwarmAverage:
    """What the part owners of a swarm round compute, as one function of the members' tensors: the
    simulator's ``combine`` (``trainer.averaging.InProcessGroup``).

    The flattened vector is cut into one part per member and each part into pieces exactly as the
    swarm cuts it (``part_bounds``, ``piece_bounds`` with ``codec``'s blocks), and each piece is
    combined by ``aggregator``; the result is not encoded (a ``CompressingMember`` around the group
    re-encodes it, as the owners do)."""

    def __init__(self, aggregator: str = "mean", codec: Codec | None = None, piece_elems: int = PIECE_ELEMS,
                 owns: list[bool] | None = None) -> None:
        """``owns``: which members own a part, in member order (``Group.owners``; None: all)."""
        aggregate(aggregator, [1.0], [torch.zeros(1)])  # an unknown name fails here, not mid-run
        self.aggregator = aggregator
        self.owns = owns
        self.codec = codec if codec is not None else get_codec("fp32")
        self.piece_elems = piece_elems * self.codec.piece_factor  # as p2p/group.py cuts them

    def __call__(self, contributions: list[tuple[list[torch.Tensor], float]]) -> list[torch.Tensor]:
        like = contributions[0][0]
        weights = [w for _, w in contributions]
        flats = [flatten(tensors) for tensors, _ in contributions]
        out = torch.empty_like(flats[0])
        owns = self.owns if self.owns is not None else [True] * len(flats)
        for start, end in owned_bounds(out.numel(), owns):
            for s, e in piece_bounds(start, end, self.codec, self.piece_elems):
                out[s:e] = aggregate(self.aggregator, weights, [f[s:e] for f in flats])
        return [t.to(ref.dtype) for t, ref in zip(unflatten(out, like, copy=False), like)]


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


def base_vector(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The fp32 CPU vector that ``tensors`` are consecutive views of, in order and covering it
    whole (what ``unflatten(..., copy=False)`` makes), or the one vector given itself; None if
    they are not."""
    if not tensors:
        return None
    base = tensors[0]._base
    if base is None and len(tensors) == 1:  # a vector of its own, not a view
        base = tensors[0]
    if (base is None or base.dim() != 1 or base.dtype != torch.float32 or base.device.type != "cpu"
            or not base.is_contiguous()):
        return None
    at = base.storage_offset()
    for t in tensors:
        if (t._base is not base and t is not base) or not t.is_contiguous() or t.storage_offset() != at:
            return None
        at += t.numel()
    return base if at == base.storage_offset() + base.numel() else None


def unflatten(flat: torch.Tensor, like: list[torch.Tensor], *, copy: bool = True) -> list[torch.Tensor]:
    """``flat`` cut into tensors shaped like ``like``; ``copy=False`` returns views of ``flat``
    (for a buffer nobody else writes to, such as a round's fresh result)."""
    out, offset = [], 0
    for t in like:
        view = flat[offset : offset + t.numel()].view_as(t)
        out.append(view.clone() if copy else view)
        offset += t.numel()
    return out


class CommittedAverage(Sequence[torch.Tensor]):
    """A committed round's average, shaped like the caller's tensors, decoded as it is read.

    It holds the averaged pieces as their owners encoded them (each checked when it was placed,
    so none fails to decode) and decodes them, in vector order, only as far as the tensor read
    needs. The outer step reads tensor after tensor, so each piece is decoded just before it is
    used, on the outer step's thread, while it is still in cache: the round returns at its
    commit instead of after a pass over the whole vector (on the round's path).

    With ``out`` (a vector nobody needs any more: the donated pseudo-gradient) the tensors are
    views of it, filled as they are read. Without (the round's vector holds the next error-feedback
    residual then, ``Group.in_place``) each read decodes into a tensor of its own, so no fp32
    vector of the whole average ever exists: the outer step holds one tensor of it at a time.
    ``views`` give the shapes without decoding anything; ``decoded()`` decodes every tensor."""

    def __init__(self, codec: Codec, pieces: list[tuple[int, int]], encoded: list, like: list[torch.Tensor],
                 out: torch.Tensor | None = None) -> None:
        numel = sum(t.numel() for t in like)
        assert [s for s, _ in pieces] == [0, *(e for _, e in pieces[:-1])][: len(pieces)], "pieces in vector order"
        assert (pieces[-1][1] if pieces else 0) == numel and (out is None or out.numel() == numel)
        assert len(encoded) == len(pieces) and all(d is not None for d in encoded)
        self._out = out
        self.views = unflatten(out if out is not None else torch.empty(numel, device="meta"), like, copy=False)
        self._bounds, at = [], 0  # each tensor's [start, end) in the vector
        for t in like:
            self._bounds.append((at, at + t.numel()))
            at += t.numel()
        self._codec, self._pieces, self._encoded = codec, pieces, encoded
        self._next = self._upto = 0  # into ``out``: pieces decoded, values they cover
        self._cached: tuple[int, torch.Tensor] | None = None  # without ``out``: the last piece decoded
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.views)

    def wire(self) -> tuple[str, list[tuple[int, int]], list]:
        """(codec name, piece bounds, encoded pieces) as they came over the wire; before any
        tensor is read (reading drops the pieces it decoded)."""
        assert self._next == 0 and self._cached is None, "the average's pieces before it is read"
        return self._codec.name, list(self._pieces), list(self._encoded)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        view = self.views[i]  # IndexError ends an iteration
        start, end = self._bounds[i % len(self.views)]
        with self._lock:
            if self._out is not None:
                self._decode_through(end)
                return view
            return self._decode_range(start, end).view_as(view)

    def decoded(self) -> list[torch.Tensor]:
        """Every tensor, decoded (without ``out``, into tensors of their own)."""
        return [self[i] for i in range(len(self))]

    def _decode_through(self, end: int) -> None:
        while self._upto < end:
            start, stop = self._pieces[self._next]
            self._codec.decode(self._encoded[self._next], stop - start, self._out[start:stop])
            self._encoded[self._next] = None  # its bytes are no longer held
            self._next, self._upto = self._next + 1, stop

    def _decode_range(self, start: int, end: int) -> torch.Tensor:
        """Values [start, end) of the average in a new tensor, from the pieces that cover them."""
        values = torch.empty(end - start, dtype=torch.float32)
        k = bisect.bisect_right(self._pieces, (start, float("inf"))) - 1 if end > start else len(self._pieces)
        while k < len(self._pieces) and self._pieces[k][0] < end:
            p_start, p_end = self._pieces[k]
            if start <= p_start and p_end <= end:  # a whole piece: straight into place
                self._codec.decode(self._encoded[k], p_end - p_start, values[p_start - start : p_end - start])
            else:  # a piece shared with the next tensor (or the last): decoded once for both
                if self._cached is None or self._cached[0] != k:
                    self._cached = (k, self._codec.decode(self._encoded[k], p_end - p_start))
                lo, hi = max(start, p_start), min(end, p_end)
                values[lo - start : hi - start] = self._cached[1][lo - p_start : hi - p_start]
            k += 1
        return values


class CompressingMember:
    """Simulator averager: what the swarm's codec does to one member's round, around an
    exact in-process average of the k members (``trainer.averaging.InProcessGroup``).

    As in the swarm: the member sends each part encoded with ``codec``, the owners encode the
    average with ``codec.average``, and error feedback keeps what was not delivered (what the
    codec dropped, and what the average dropped: ``Codec.support``) times ``decay``."""

    def __init__(self, inner, codec: Codec, members: int, *, feedback: bool = True, decay: float = 1.0) -> None:
        self.inner = inner
        self.codec = codec
        self.members = members
        self.feedback = feedback
        self.decay = decay
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
        # The owners' re-encoding of each averaged part, decoded by everyone.
        average = self.codec.average
        payloads, received = encode_parts(average, flatten(averaged), bounds)
        if self._ef is not None:
            if average is not self.codec:  # what the average dropped was delivered by nobody
                kept = torch.cat([average.support(p, end - start) for p, (start, end) in zip(payloads, bounds)])
                sent.masked_fill_(~kept, 0.0)
            self._ef.update(compensated, sent)
            if self.decay != 1.0:
                self._ef.residual.mul_(self.decay)
        return unflatten(received, tensors)
