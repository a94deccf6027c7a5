"""The part a member owns in one attempt, as the members' inputs to it come in.

Each member opens ``lanes`` streams to the owner, every one starting with the
member's weight, and sends its input to each piece of the part; the owner
keeps the inputs to a piece (as they came, checked: p2p/group.py's
``check_piece``) until every member's is in, averages them
(``Group.reduce_piece``) and drops them. This class is that bookkeeping, with
the hash of every input for the owner's declaration (p2p/owneraudit.py); the
waiting on it and the tensor work stay with ``Group``.
"""

from __future__ import annotations

import math

import torch

from p2p.digests import DECLARED, input_hash
from p2p.failure import RoundFailed


class OwnedPart:
    """What this member, the owner of a part, has received of it and averaged so far."""

    def __init__(self, members: int, pieces: list[tuple[int, int]], lanes: int) -> None:
        """``pieces``: the bounds of every piece of the part; ``lanes``: the streams each member opens for it."""
        self._members = members
        self._pieces = pieces
        self._lanes = lanes
        self.weights: dict[int, float] = {}  # member index -> its weight, as its first lane said
        self._lanes_in: set[tuple[int, int]] = set()  # (sender, lane) streams that reached us
        # Per piece: sender index -> its input (values, or a checked payload), until the piece is averaged.
        self._inputs: list[dict[int, torch.Tensor | bytes]] = [{} for _ in pieces]
        # Per piece: sender index -> input_hash of its encoded piece (for the declaration).
        self._hashes: list[dict[int, bytes]] = [{} for _ in pieces]
        self.reduced: list[bytes | None] = [None] * len(pieces)  # the encoded average of each piece
        self.declared: list[bytes | None] = [None] * len(pieces)  # our declaration of each piece
        self._reduced_count = 0

    def add_weight(self, sender: int, weight: float) -> None:
        """A member's weight, sent once before its pieces; reject what cannot be a real one."""
        if sender in self.weights:
            raise RoundFailed("duplicate_part")
        if not (isinstance(weight, float) and math.isfinite(weight) and weight > 0):
            raise RoundFailed("bad_weight")
        self.weights[sender] = weight

    def add_lane(self, sender: int, lane: int, weight: float) -> None:
        """A member opened ``lane`` of our part; each lane's header repeats the member's weight."""
        if not 0 <= lane < self._lanes:
            raise RoundFailed("bad_lane")
        if (sender, lane) in self._lanes_in:
            raise RoundFailed("duplicate_part")
        if sender in self.weights:
            if weight != self.weights[sender]:
                raise RoundFailed("bad_weight")
        else:
            self.add_weight(sender, weight)
        self._lanes_in.add((sender, lane))

    def hashed(self, k: int, sender: int, payload: bytes) -> None:
        """Keep the hash of ``sender``'s encoded input to piece ``k`` (for our declaration)."""
        self._hashes[k][sender] = input_hash(payload)

    def add_piece(self, sender: int, k: int, values: torch.Tensor | bytes) -> bool:
        """Store one member's piece ``k`` (its values, or its payload as ``Group.check_piece``
        passed it); True once every member's piece ``k`` is in."""
        start, end = self._pieces[k]
        assert sender in self.weights and (not isinstance(values, torch.Tensor) or values.numel() == end - start)
        inputs = self._inputs[k]
        if sender in inputs or self.reduced[k] is not None:
            raise RoundFailed("duplicate_part")
        inputs[sender] = values
        return len(inputs) == self._members

    def inputs(self, k: int) -> list[torch.Tensor | bytes]:
        """Every member's input to piece ``k``, in member order (all are in)."""
        return [self._inputs[k][i] for i in range(self._members)]

    def declaration(self, k: int, gram: bytes) -> bytes:
        """What we declare of piece ``k``'s inputs: every member's weight and input hash, in
        member order, then their Gram matrix (``gram``, p2p/scores.py). It travels with the
        averaged piece and is part of the vote."""
        hashes = self._hashes[k]
        return b"".join(DECLARED.pack(self.weights[i], hashes[i]) for i in range(self._members)) + gram

    def set_reduced(self, k: int, data: bytes) -> None:
        """Piece ``k`` is averaged (``data``, encoded): its inputs are no longer needed."""
        self.reduced[k] = data
        self._inputs[k] = {}
        self._reduced_count += 1

    def all_reduced(self) -> bool:
        return self._reduced_count == len(self.reduced)

    def unreduced(self) -> dict[int, torch.Tensor | bytes] | None:
        """The inputs in so far to the first piece not yet averaged (None: every piece is)."""
        return next((self._inputs[k] for k, data in enumerate(self.reduced) if data is None), None)
