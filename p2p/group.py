"""One averaging group: the agreed members of a round and the state of its all-reduce.

The all-reduce is a butterfly: the flat pseudo-gradient is cut into one
contiguous part per member; member ``j`` receives part ``j`` from everyone
(encoded with the swarm's codec), reduces it once (weighted sum in member
order, so the result does not depend on arrival order), encodes the average
once and sends the same bytes back to all. Every member decodes those bytes,
so all end with a bit-identical average. Before anyone applies it, members exchange a
digest of the whole averaged vector (``votes``): a round commits only if every
member reports the same digest.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass, field

import torch

from p2p.codecs import Codec, CodecError
from p2p.compression import average_part, encode_parts, part_bounds


class RoundFailed(Exception):
    """The group cannot commit; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def digest(vector: torch.Tensor, group_id: bytes) -> bytes:
    """What members vote on: the averaged vector, bound to this group."""
    h = hashlib.blake2b(digest_size=16, key=group_id[:64])
    h.update(vector.numpy().tobytes())
    return h.digest()


@dataclass(eq=False)
class Group:
    """Membership and progress of one round attempt on this peer."""

    id: bytes
    round: int
    members: list[str]
    me: str
    flat: torch.Tensor  # this peer's contribution (fp32, 1-D), error feedback already added
    weight: float
    codec: Codec
    contributions: dict[int, tuple[float, torch.Tensor]] = field(default_factory=dict)
    votes: dict[int, bytes] = field(default_factory=dict)
    failure: RoundFailed | None = None

    def __post_init__(self) -> None:
        assert self.me in self.members and self.members == sorted(self.members)
        self.index = self.members.index(self.me)
        self.bounds = part_bounds(self.flat.numel(), len(self.members))
        self.result = torch.empty_like(self.flat)
        self._changed = asyncio.Event()
        self._reduced: bytes | None = None
        # What we send for each part, and what its receiver will decode (for error feedback).
        self.payloads, self.sent = encode_parts(self.codec, self.flat, self.bounds)
        self.add_contribution(self.index, self.weight, self.sent[slice(*self.bounds[self.index])])

    @property
    def leader(self) -> str:
        return self.members[0]

    def member_index(self, peer_id: str) -> int | None:
        try:
            return self.members.index(peer_id)
        except ValueError:
            return None

    def part_numel(self, index: int) -> int:
        start, end = self.bounds[index]
        return end - start

    def wire_bytes(self, index: int) -> int:
        """Size of an encoded part ``index``, both ways."""
        return self.codec.wire_bytes(self.part_numel(index))

    def decode(self, index: int, data: bytes) -> torch.Tensor:
        """Decode part ``index`` from a peer; refuse anything malformed."""
        try:
            return self.codec.decode(data, self.part_numel(index))
        except CodecError as e:
            raise RoundFailed("bad_payload", e.reason) from None

    # ---- events ----------------------------------------------------------------

    def fail(self, reason: str, detail: str = "") -> None:
        if self.failure is None:
            self.failure = RoundFailed(reason, detail)
            self._changed.set()

    async def _wait(self, predicate, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not predicate():
            if self.failure is not None:
                raise self.failure
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RoundFailed("timeout")
            self._changed.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                pass
        if self.failure is not None:
            raise self.failure

    # ---- reduce: this peer owns part ``self.index`` -----------------------------

    def add_contribution(self, sender: int, weight: float, part: torch.Tensor) -> None:
        """Store one member's slice of our part; reject what cannot be a real contribution."""
        if sender in self.contributions:
            raise RoundFailed("duplicate_part")
        if not (isinstance(weight, float) and math.isfinite(weight) and weight > 0):
            raise RoundFailed("bad_weight")
        if part.numel() != self.part_numel(self.index):
            raise RoundFailed("bad_size")
        if not bool(torch.isfinite(part).all()):
            raise RoundFailed("non_finite")
        self.contributions[sender] = (weight, part)
        self._changed.set()

    async def reduced_part(self, deadline: float) -> bytes:
        """The encoded average of the part this peer owns, once every member contributed."""
        await self._wait(lambda: len(self.contributions) == len(self.members), deadline)
        if self._reduced is None:
            # Fixed member order: the same bytes whatever the arrival order.
            self._reduced = average_part(self.codec, [self.contributions[i] for i in range(len(self.members))])
            self.place(self.index, self._reduced)
        return self._reduced

    def place(self, index: int, data: bytes) -> None:
        """Store the encoded average of part ``index`` (from its owner, or our own)."""
        start, end = self.bounds[index]
        self.result[start:end] = self.decode(index, data)

    # ---- vote --------------------------------------------------------------------

    def add_vote(self, sender: int, value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != 16:
            raise RoundFailed("bad_vote")
        self.votes.setdefault(sender, value)
        self._changed.set()

    async def agreed(self, deadline: float) -> bool:
        await self._wait(lambda: len(self.votes) == len(self.members), deadline)
        return len(set(self.votes.values())) == 1
