"""A member's check on the part owners of one attempt: declarations and the audit's recompute.

With each averaged piece its owner sends a declaration of the piece's inputs:
every member's weight and input hash, in member order (``DECLARED``,
p2p/digests.py), and their Gram matrix (p2p/scores.py). It is part of the vote, so every member holds the same one.
A member checks its own weight in it as it arrives (``check_declaration``) and
its own input hash only when an auditor asks for that input
(``check_own_input``). The member audits one owner, the previous one in member
order (``owner``): a random piece of its part (``target``), recomputed from
every member's input against the declaration (``recompute``; the requests
that fetch the inputs are p2p/audit.py's).

The recompute is pure and runs in a worker thread (``exchange.off_loop``).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from p2p.aggregate import counted_weights
from p2p.codec import Codec, CodecError
from p2p.digests import DECLARED, declared_gram, input_hash, parse_declaration, piece_digest
from p2p.failure import RoundFailed
from p2p.scores import gram_bytes, gram_matches, parse_gram, piece_gram


class OwnerAudit:
    """The owners' declarations as this member got them, and its audit of one owner's part."""

    def __init__(self, members: int, index: int, owns: list[bool], pieces: list[list[tuple[int, int]]],
                 placed: list[list[bytes | None]], *, codec: Codec, weight: float, weight_cap: float,
                 factors: list[float], aggregate: Callable[[list[tuple[float, torch.Tensor]]], bytes]) -> None:
        """``index``: this member's; ``owns``: per member, whether it owns a part; ``pieces``: the
        bounds of every piece of every part; ``placed``: the group's ``piece_digest`` of every
        averaged piece, filled as they are placed (read here, never written); ``weight``: the
        weight this member told the owners; ``factors``: the members' standing (``Group.factors``);
        ``aggregate``: how an owner combines a piece's contributions (``Group.aggregate``)."""
        self._members = members
        self._index = index
        self._owns = owns
        self._pieces = pieces
        self._placed = placed
        self._codec = codec
        self._weight = weight
        self._weight_cap = weight_cap
        self._factors = factors
        self._aggregate = aggregate
        # What each owner declared of each averaged piece's inputs, as it was placed.
        self.declared: list[list[bytes | None]] = [[None] * len(p) for p in pieces]

    def owner(self) -> int | None:
        """The member whose part this member audits: the previous owner, in member order, if this
        member owns a part itself (a member that owns none may not be able to dial every other
        member, which an audit does). None in a group with a single owner."""
        ring = [i for i, owns in enumerate(self._owns) if owns]
        if not self._owns[self._index] or len(ring) < 2:
            return None
        return ring[ring.index(self._index) - 1]

    def target(self) -> tuple[int, int] | None:
        """The (part, piece) this member audits: a random piece of the audited owner's part,
        drawn once that owner has sent every piece (so it cannot know which one). None in a
        group of one, for a member that owns no part, or if that part is empty."""
        owner = self.owner()
        if owner is None or not self._pieces[owner]:
            return None
        assert all(d is not None for d in self._placed[owner]), "audit before the owner's part is in"
        return owner, int.from_bytes(os.urandom(8), "big") % len(self._pieces[owner])

    def place(self, index: int, k: int, declared: bytes) -> None:
        """Keep the declaration of piece ``k`` of part ``index`` (b"": none came)."""
        self.declared[index][k] = declared or None

    def check_declaration(self, index: int, k: int, declared: bytes) -> None:
        """A member's check of an owner's declaration as it arrives: well formed, our own weight.
        Our own input's hash in it matters only to an audit of the piece: checked then
        (``check_own_input``), not hashed for every piece we send."""
        if len(declared) != DECLARED.size * self._members + gram_bytes(self._members):
            raise RoundFailed("owner_misreported", "declaration of the wrong size")
        weight, _ = DECLARED.unpack_from(declared, DECLARED.size * self._index)
        if weight != self._weight:
            raise RoundFailed("owner_misreported", f"our weight for piece {k} of part {index}")
        try:
            parse_gram(declared_gram(declared, self._members), self._members)
        except ValueError as e:
            raise RoundFailed("owner_misreported", f"piece {k} of part {index}: {e}") from None

    def grams(self) -> list[list[float]]:
        """Every averaged piece's Gram matrix as its owner declared it (checked on arrival:
        ``check_declaration``), in vector order: what the round's scores sum (p2p/scores.py)."""
        out = []
        for part in self.declared:
            for declared in part:
                assert declared is not None, "scores before every piece was placed"
                out.append(parse_gram(declared_gram(declared, self._members), self._members))
        return out

    def weights(self) -> list[tuple[float, float]]:
        """Per member, the least and the most weight the owners declared it sent (a liar may claim
        one weight to one owner and another to the next: each owner checks only its own lanes)."""
        seen = [[] for _ in range(self._members)]
        for part in self.declared:
            for declared in part:
                for i, (w, _) in enumerate(parse_declaration(declared, self._members)):
                    seen[i].append(w)
                break  # one declaration a part: an owner checks a member's weight is the same on every lane
        return [(min(ws), max(ws)) if ws else (0.0, 0.0) for ws in seen]

    def check_own_input(self, index: int, k: int, payload: bytes) -> None:
        """Before our input to piece ``k`` of part ``index`` goes to its auditor (``payload``, the
        bytes we sent the owner): the owner's declaration, which every member votes on, records
        it. Otherwise the owner lied about it, and the audit would blame us."""
        declared = self.declared[index][k]
        assert declared is not None, "the piece's declaration is placed before it is audited"
        _, hashed = DECLARED.unpack_from(declared, DECLARED.size * self._index)
        if hashed != input_hash(payload):
            raise RoundFailed("owner_misreported", f"our input to piece {k} of part {index}")

    def recompute(self, index: int, k: int, payloads: list[bytes]) -> str | None:
        """Recompute piece ``k`` of part ``index`` from every member's encoded input and the
        owner's declared weights; the member index at fault, as text, or None if all is well.

        An input whose hash differs from the declaration (every member checked its own entry and
        voted on the declaration) is a member lying to us; an average that differs is the owner's."""
        declared = parse_declaration(self.declared[index][k], self._members)
        for i, (payload, (_, hashed)) in enumerate(zip(payloads, declared)):
            if input_hash(payload) != hashed:
                return str(i)
        start, end = self._pieces[index][k]
        weights = counted_weights([w for w, _ in declared], self._weight_cap, self._factors)
        try:
            values = [self._codec.decode(p, end - start) for p in payloads]
        except CodecError:
            return str(index)  # the owner declared (and averaged) an input that does not decode
        gram = parse_gram(declared_gram(self.declared[index][k], self._members), self._members)
        recomputed = parse_gram(piece_gram(values), self._members)
        if not gram_matches(gram, recomputed, self._members):
            return str(index)  # the owner misreported the inputs' inner products (the scores)
        data = self._aggregate(list(zip(weights, values)))
        if piece_digest(data, self.declared[index][k]) != self._placed[index][k]:
            return str(index)
        return None
