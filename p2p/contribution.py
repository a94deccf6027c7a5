"""This member's vector in one group attempt, and what encoding it leaves behind.

A member sends every owner its piece of the owner's part, encoded with the swarm's codec
(``encode``). A lossy codec drops something of each piece: what the receivers of our own
part decode of it is what we average for that part ourselves (``sent``), and with error
feedback what was dropped is the next round's residual, written piece by piece as they
are encoded (``residual``), or only once the round commits when the residual's vector is
our vector itself (``in_place``, ``write_residual``).

All of it is tensor work on disjoint slices, pure given the codec, so the exchange runs
it in worker threads (p2p/exchange.py ``off_loop``) while the event loop keeps the streams
moving. A codec error (NaN or Inf in our own vector) is raised as ``CodecError``; the group
turns it into the round's failure.
"""

from __future__ import annotations

import threading

import torch

from p2p.codec import Codec

_local = threading.local()
SCRATCH_ELEMS = 1 << 18  # the least a thread's decode scratch holds (one piece: p2p/group.py PIECE_ELEMS)


def _decode_scratch(n: int) -> torch.Tensor:
    """A vector of ``n`` values for this thread's decodes that are used at once (reused)."""
    buf = getattr(_local, "decoded", None)
    if buf is None or buf.numel() < n:
        buf = _local.decoded = torch.empty(max(n, SCRATCH_ELEMS), dtype=torch.float32)
    return buf[:n]


class Contribution:
    """Our vector ``flat`` in one attempt, our own part ``own`` = [start, end) of it."""

    def __init__(self, flat: torch.Tensor, codec: Codec, residual: torch.Tensor | None, sent: torch.Tensor | None,
                 own: tuple[int, int]) -> None:
        """``residual``: error feedback's vector, shaped like ``flat`` (None without feedback;
        ``flat`` itself in place). ``sent``: a buffer the size of our own part for what its
        receivers decode, reused round after round (None: a fresh one; unused by an exact codec
        or in place)."""
        assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.is_contiguous()
        self.flat, self.codec, self.residual = flat, codec, residual
        own_start, own_end = own
        # What the receivers decode of our contribution to our own part, filled as its pieces are
        # encoded: we average our piece as everyone else would decode it.
        if codec.exact:
            self.sent, self._sent_base = flat, 0
            assert residual is None, "an exact codec drops nothing to feed back"
        elif self.in_place:
            self.sent, self._sent_base = None, own_start
        else:
            self.sent = sent if sent is not None else torch.empty(own_end - own_start, dtype=torch.float32)
            self._sent_base = own_start
            assert self.sent.shape == (own_end - own_start,), "sent holds our own part"
        for buf in (self.sent, residual):
            assert buf is None or (buf.dim() == 1 and buf.dtype == torch.float32 and buf.is_contiguous())
        assert residual is None or residual.shape == flat.shape

    @property
    def in_place(self) -> bool:
        """Error feedback's vector is ``flat`` itself, holding our compensated contribution
        (``ShardPlane.fold``); the round leaves it as it is, and only once it commits is the next
        residual written over it (``write_residual``). Nothing of what we send is kept: the codec
        is a pure function of the values, so an auditor's request and our own part's input are
        encoded again from ``flat``, and a failed attempt has nothing to give back. No vector of
        the pseudo-gradient, of what our part's receivers decode, nor of the average exists beside
        it, nor our payloads (a byte per value for int8)."""
        return self.residual is not None and self.residual is self.flat

    def encode(self, start: int, end: int, own: bool) -> bytes:
        """Our values [start, end) encoded (``own``: a piece of our own part); records what its
        receivers decode of our own part, and what error feedback keeps of every part."""
        values = self.flat[start:end]
        if self.in_place:
            return self.codec.encode(values)  # nothing decoded: only a commit writes the residual
        if own and not self.codec.exact:
            decoded = self.sent_values(start, end)
        else:  # decoded straight into the residual, then turned into it while still in cache
            decoded = None if self.residual is None else self.residual[start:end]
        payload = self.codec.encode(values, decoded)
        if self.residual is not None:
            torch.sub(values, decoded, out=self.residual[start:end])
        return payload

    def again(self, start: int, end: int) -> bytes:
        """Our values [start, end) encoded again, for an auditor: the codec is a pure function of
        the values, so these are the bytes the owner got (nothing else is written)."""
        return self.codec.encode(self.flat[start:end])

    def own_input(self, start: int, end: int, payload: bytes | None = None) -> torch.Tensor | bytes:
        """Our input to the average of [start, end) of our own part (encoded already): what every
        receiver decodes of it, as values or, in place, as its payload (``payload``, what
        ``encode`` just gave for it, or encoded again)."""
        if self.in_place:
            return payload if payload is not None else self.again(start, end)
        return self.sent_values(start, end)

    def sent_values(self, start: int, end: int) -> torch.Tensor:
        """What the receivers decode of our contribution to [start, end) of our own part."""
        return self.sent[start - self._sent_base : end - self._sent_base]

    def write_residual(self, pieces, support=None, decay: float = 1.0) -> None:
        """Once the round committed: the next residual, piece by piece (``pieces``: every part's
        (start, end) pieces), what the round did not deliver of what we sent, times ``decay``.

        In place it is written over ``flat``: each piece encoded again (the bytes we sent),
        what the codec dropped. Otherwise it was written as the pieces were encoded, and only
        the rest is done here. ``support(j, k)``: which values the averaged piece k of part j
        kept (a sparse codec's owner keeps fewer than its inputs carry), or None for all; a
        value the average dropped was delivered by nobody, so all of it stays ours, as if it
        had not been sent."""
        if self.residual is None:
            return
        for j, part in enumerate(pieces):
            for k, (start, end) in enumerate(part):
                values, kept = self.flat[start:end], None if support is None else support(j, k)
                if self.in_place:
                    decoded = _decode_scratch(end - start)
                    self.codec.encode(values, decoded)
                    if kept is not None:
                        decoded.masked_fill_(~kept, 0.0)
                    values.sub_(decoded)
                elif kept is not None:
                    residual = self.residual[start:end]
                    torch.where(kept, residual, values, out=residual)
                if decay != 1.0:
                    self.residual[start:end].mul_(decay)
