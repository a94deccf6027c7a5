"""One averaging group: the agreed members of a round and the state of its all-reduce.

The all-reduce is a butterfly: the flat pseudo-gradient is cut into one
contiguous part per member that owns one; owner ``j`` receives part ``j`` from
everyone (encoded with the swarm's codec), averages it (weighted sum in member
order, so the result does not depend on arrival order), encodes the average once
and sends the same bytes back to all. Every member decodes those bytes, so all
end with a bit-identical average. Before anyone applies it, members exchange a
digest of the whole averaged vector (``votes``): a round commits only if every
member reports the same digest. The digest is built piece by piece as the
averaged pieces are placed (p2p/digests.py), so hashing overlaps the transfer
instead of following it.

Parts travel as pieces (``compression.piece_bounds``, whole codec blocks), so
the two halves of the butterfly overlap: the owner averages piece ``k`` as
soon as every member's piece ``k`` is in and streams it back while later
pieces are still arriving. Piece boundaries are fixed by the group alone
(vector size, members, codec), never by arrival, so the bytes are the same.

The tensor work (``encode_piece``, ``check_piece``, ``reduce_piece``,
``place_piece``; our own vector's side in p2p/contribution.py) is pure and
touches disjoint slices, so the round protocol runs it in worker threads (torch
releases the GIL) while the event loop keeps the streams moving; all
bookkeeping stays on the event loop. ``p2p/votes.py`` carries the vote and the
aborts between members; this class holds what they decide on, with the pieces
it owns: ``OwnedPart`` (p2p/ownedpart.py: the inputs to our own part as they
come), ``OwnerAudit`` (p2p/owneraudit.py: the owners' declarations and the
audit's recompute) and ``Aborts`` (p2p/aborts.py: who started the aborts).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from p2p.aborts import Aborts
from p2p.aggregate import counted_weights
from p2p.codec import Codec, CodecError
from p2p.compression import CommittedAverage, average_part, owned_bounds, piece_bounds
from p2p.contribution import Contribution
from p2p.digests import digest, piece_digest
from p2p.failure import RoundFailed
from p2p.hostile import HONEST, Behaviour
from p2p.lanes import LANES, MAX_LANES
from p2p.ownedpart import OwnedPart
from p2p.owneraudit import OwnerAudit
from p2p.ledger import Entry, build_entry
from p2p.scores import member_scores, piece_gram, total_gram

# Values per piece (rounded down to whole codec blocks): 1 MB of fp32, 256 KB
# of int8, 128 KB of a 4-bit codec. Measured on the 4-host 100 Mbit/s testbed
# (25M values): 2^18 beat 2^20 and 2^22 (finer overlap of the two halves,
# less left to do after the last input arrives); 2^16 cost ~35% more CPU per
# sync for no clear gain on two shared cores.
PIECE_ELEMS = 1 << 18


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
    # Error feedback (lossy codecs): a vector shaped like ``flat`` that receives, piece by
    # piece as they are encoded, what the receivers will not get of ``flat`` (``flat`` minus
    # what they decode): the next residual, if this round commits. None without feedback.
    residual: torch.Tensor | None = None
    # Where ``sent`` goes (the size of our own part: only our part's pieces are averaged here): a
    # buffer the caller reuses round after round, or None for a fresh one. Unused by an exact
    # codec, whose receivers decode ``flat`` itself.
    sent: torch.Tensor | None = None
    # How the owner combines its part's pieces (p2p/aggregate.py) and the cap on a weight (0: relative).
    aggregator: str = "mean"
    weight_cap: float = 0.0
    # Error feedback's residual is multiplied by this when a round commits (SparseLoCo's beta).
    feedback_decay: float = 1.0
    hostile: Behaviour = HONEST  # test-only lies of this member (p2p/hostile.py)
    lanes_per_part: int = LANES  # the group's lanes (``lanes``), chosen by its leader (``lanes_for_rtt``)
    # The members that own a part (sorted; None: all), chosen by the leader, who is the first of
    # them. A member that cannot be dialled (behind NAT) owns none: it only dials the owners, and
    # no two such members ever need to meet (docs/wan.md, "NAT").
    owners: list[str] | None = None
    rtt: float | None = None  # seconds to the farthest other member, as this peer measured it (None: unknown)
    # Per member, the share of its capped weight the average counts: its standing in the ledger
    # (p2p/ledger.py), the same on every member (the leader's proposal names it). None: all 1.
    factors: list[float] | None = None
    # Check records of earlier rounds the leader proposed (p2p/checks.py): this round's entry carries them.
    checks: list = field(default_factory=list)
    votes: dict[int, bytes] = field(default_factory=dict)
    failure: RoundFailed | None = None
    failed_by: str | None = None  # the member whose stream to us the failure came on, if one did
    deadline: float = 0.0  # loop time by which the exchange must be over (set when it starts)
    # Members whose input (or, as owners, whose output) this peer refused: member -> reason.
    blame: dict[str, str] = field(default_factory=dict)
    # When this attempt reached each step on this peer (time.monotonic): "exchanged" (every part
    # placed), "audited" (this member's audit clean too), "voted" (every vote in). See ``phases``.
    marks: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.me in self.members and self.members == sorted(self.members)
        assert 1 <= self.lanes_per_part <= MAX_LANES
        self.index = self.members.index(self.me)
        if self.factors is None:
            self.factors = [1.0] * len(self.members)
        assert len(self.factors) == len(self.members) and all(0 < f <= 1 for f in self.factors)
        owners = set(self.members if self.owners is None else self.owners)
        assert self.owners is None or (self.owners == sorted(owners) and owners <= set(self.members)
                                       and 2 <= len(owners) < len(self.members))
        self.owns = [m in owners for m in self.members]  # per member: whether it owns a part
        self.bounds = owned_bounds(self.flat.numel(), self.owns)
        # pieces[j][k]: the elements of piece k of part j, the same on every member.
        self.pieces = [piece_bounds(start, end, self.codec, PIECE_ELEMS * self.codec.piece_factor)
                       for start, end in self.bounds]
        # Our vector and what encoding it leaves (p2p/contribution.py); ``sent`` is the buffer it uses.
        self.mine = Contribution(self.flat, self.codec, self.residual, self.sent, self.bounds[self.index])
        self.sent = self.mine.sent
        # Our encoded pieces as the owners got them, kept for a checker if the round commits and
        # we are sampled (p2p/checks.py): one encoded copy of our vector.
        self.kept: dict[tuple[int, int], bytes] = {}
        self.gram_seconds = 0.0  # spent on the Gram matrices of our part (the scores' cost here)
        # The inputs to our own part as they come, and its averaged pieces (p2p/ownedpart.py).
        self.part = OwnedPart(len(self.members), self.pieces[self.index], self.lanes(self.index))
        # piece_digest of every averaged piece of every part, filled as they are placed.
        self._placed: list[list[bytes | None]] = [[None] * len(p) for p in self.pieces]
        # The averaged pieces as their owners encoded them (checked), until the round commits:
        # only then are they decoded, over ``flat`` (``committed_average``). An encoded average is what
        # a member holds of the round's result meanwhile (1 byte per value for int8, 0.5 for a
        # 4-bit codec) instead of a second fp32 vector; ``flat`` must stay whole until then,
        # for audits and for a retry if the attempt fails.
        self._averaged: list[list[bytes | bytearray | None]] = [[None] * len(p) for p in self.pieces]
        # The owners' declarations of each averaged piece's inputs, and our audit of one owner.
        self.audit = OwnerAudit(len(self.members), self.index, self.owns, self.pieces, self._placed,
                                codec=self.codec, weight=self.claimed_weight, weight_cap=self.weight_cap,
                                factors=self.factors, aggregate=self.aggregate)
        # Members that sent an abort while this peer had no failure of its own (p2p/aborts.py).
        self.aborts = Aborts(self.members)
        self._changed = asyncio.Event()
        self.part.add_weight(self.index, self.weight)

    @property
    def in_place(self) -> bool:
        """Error feedback's vector is ``flat`` itself (``Contribution.in_place``)."""
        return self.mine.in_place

    @property
    def claimed_weight(self) -> float:
        """The weight we tell the owners (a test-only hostile member claims another, p2p/hostile.py)."""
        return self.weight if self.hostile.weight is None else self.hostile.weight

    @property
    def leader(self) -> str:
        return (self.owners or self.members)[0]

    def owner_indices(self) -> list[int]:
        return [i for i, owns in enumerate(self.owns) if owns]

    def voters(self) -> list[int]:
        """The members whose votes this member waits for: all, if it owns a part; the owners
        otherwise. An owner votes to the members that own none only once every vote is in and
        equal (``RoundProtocol._allreduce``), so their votes carry the whole group's agreement."""
        return list(range(len(self.members))) if self.owns[self.index] else self.owner_indices()

    def member_index(self, peer_id: str) -> int | None:
        try:
            return self.members.index(peer_id)
        except ValueError:
            return None

    def wire_bytes(self, index: int) -> int:
        """Size of an encoded part ``index``, both ways (the sum of its pieces)."""
        return sum(self.piece_bytes(index, k) for k in range(len(self.pieces[index])))

    def lanes(self, index: int) -> int:
        """Streams per member for part ``index``: the group's ``lanes_per_part``, fewer for a part of
        fewer pieces (at least 1)."""
        return max(1, min(self.lanes_per_part, len(self.pieces[index])))

    def lane_pieces(self, index: int, lane: int) -> range:
        """The pieces of part ``index`` that travel on ``lane``."""
        return range(lane, len(self.pieces[index]), self.lanes(index))

    def piece_bytes(self, index: int, k: int) -> int:
        """Size of a member's encoded piece ``k`` of part ``index``."""
        start, end = self.pieces[index][k]
        return self.codec.wire_bytes(end - start)

    def average_bytes(self, index: int, k: int) -> int:
        """Size of the owner's encoded average of piece ``k`` of part ``index`` (``Codec.average``)."""
        start, end = self.pieces[index][k]
        return self.codec.average.wire_bytes(end - start)

    def _check(self, index: int, k: int, data: bytes, codec: Codec) -> None:
        """Refuse piece ``k`` of part ``index`` if it would not decode with ``codec`` (``Codec.check``)."""
        start, end = self.pieces[index][k]
        try:
            codec.check(data, end - start)
        except CodecError as e:
            raise RoundFailed("bad_payload", e.reason) from None

    # ---- tensor work: pure, on disjoint slices, safe in a worker thread -----------

    def encode_piece(self, index: int, k: int) -> bytes:
        """Our contribution to piece ``k`` of part ``index``, encoded (``Contribution.encode``)."""
        start, end = self.pieces[index][k]
        try:
            payload = self.mine.encode(start, end, own=index == self.index)
        except CodecError as e:  # our own pseudo-gradient holds NaN or Inf: nobody may average it
            raise RoundFailed(e.reason) from None
        if index == self.index:  # our own entry of our own declaration (the others' we check if audited)
            self.part.hashed(k, self.index, payload)
        sent = self._forged(index, end - start, payload)
        self.kept[(index, k)] = sent
        return sent

    def _forged(self, index: int, numel: int, payload: bytes) -> bytes:
        """Test-only (p2p/hostile.py ``sparse=``): what a liar sends the owners of other parts
        instead of ``payload``, the same to an auditor."""
        if not self.hostile.sparse or index == self.index or self.codec is self.codec.average:
            return payload
        from p2p.hostile import forge_sparse

        return forge_sparse(self.codec, payload, numel, self.hostile.sparse)

    def own_input(self, k: int, payload: bytes | None = None) -> torch.Tensor | bytes:
        """Our input to the average of piece ``k`` of our own part (``Contribution.own_input``)."""
        start, end = self.pieces[self.index][k]
        return self.mine.own_input(start, end, payload)

    @property
    def residual_to_write(self) -> bool:
        """A commit has residual work left (``write_residual``): in place, or a residual whose
        dropped values or decay are settled only then (written as the pieces were encoded otherwise)."""
        return self.residual is not None and (self.in_place or self.codec.average is not self.codec
                                              or self.feedback_decay != 1.0)

    def write_residual(self) -> None:
        """Once the round committed, before ``committed_average``: the next residual, over ``flat``
        in place (``Contribution.write_residual``): what the codec dropped of what we sent, and
        what the averaged pieces dropped (a sparse codec's ``support``), times ``feedback_decay``."""
        average = self.codec.average

        def support(j: int, k: int) -> torch.Tensor | None:
            start, end = self.pieces[j][k]
            return average.support(self._averaged[j][k], end - start)

        self.mine.write_residual(self.pieces, support if average is not self.codec else None, self.feedback_decay)

    def sent_values(self, start: int, end: int) -> torch.Tensor:
        return self.mine.sent_values(start, end)

    def contribution(self, index: int, k: int) -> bytes:
        """Our encoded piece ``k`` of part ``index`` again, for an auditor (``Contribution.again``)."""
        start, end = self.pieces[index][k]
        return self._forged(index, end - start, self.mine.again(start, end))

    def check_piece(self, k: int, data: bytes, sender: int | None = None) -> bytes:
        """A peer's contribution to piece ``k`` of our part, refused here if it would not decode
        (``Codec.check``), and kept as it came (its hash kept for our declaration): decoded only
        when the piece is averaged, so inputs that wait for the others' hold their wire size
        (1 byte per value for int8) instead of 4."""
        self._check(self.index, k, data, self.codec)
        if sender is not None:
            self.part.hashed(k, sender, data)
        return data

    def effective_weights(self) -> list[float]:
        """Every member's weight as the average counts it (``counted_weights``)."""
        return counted_weights([self.part.weights[i] for i in range(len(self.members))], self.weight_cap,
                               self.factors)

    def declaration(self, k: int, gram: bytes) -> bytes:
        """What we, the owner, declare of piece ``k``'s inputs (``OwnedPart.declaration``)."""
        return self.part.declaration(k, gram)

    def reduce_piece(self, k: int) -> bytes:
        """Weighted mean of piece ``k`` of our part in member order, encoded once; placed in our result
        as every other member will decode it."""
        start, end = self.pieces[self.index][k]
        inputs = [x if isinstance(x, torch.Tensor) else self.codec.decode(x, end - start)  # checked when it came
                  for x in self.part.inputs(k)]
        started = time.perf_counter()
        gram = piece_gram(inputs)  # before the aggregator, which may clip in place
        self.gram_seconds += time.perf_counter() - started
        weights = self.effective_weights()
        data = self.aggregate([(weights[i], inputs[i]) for i in range(len(self.members))])
        if self.hostile.alter_slice:  # test-only: an owner that returns a finite but wrong average
            start, end = self.pieces[self.index][k]
            data = self.codec.average.encode(self.codec.average.decode(data, end - start).neg_().mul_(10.0))
        declared = self.declaration(k, gram)
        self.place_piece(self.index, k, data, declared)
        self.part.declared[k] = declared
        return data

    def aggregate(self, contributions: list[tuple[float, torch.Tensor]]) -> bytes:
        """The owner's combination of one piece's contributions, encoded once."""
        try:
            return average_part(self.codec.average, contributions, self.aggregator)
        except CodecError as e:  # an average of finite values that overflowed the codec
            raise RoundFailed("bad_average", e.reason) from None

    def place_piece(self, index: int, k: int, data: bytes, declared: bytes = b"") -> None:
        """Store piece ``k`` of the average of part ``index`` (from its owner, or our own), with the
        owner's declaration of its inputs."""
        self._check(index, k, data, self.codec.average)
        self._averaged[index][k] = data
        self._placed[index][k] = piece_digest(data, declared)
        self.audit.place(index, k, declared)

    def committed_average(self, like: list[torch.Tensor], out: torch.Tensor | None = None) -> CommittedAverage:
        """The average, shaped like ``like``, decoded as it is read (``CommittedAverage``): into
        ``out``, by default over ``flat``, only once the round committed, when nobody needs our
        contribution any more (every member voted after its audit); in place (``flat`` is error
        feedback's vector, ``write_residual``), into tensors of its own. The encoded pieces move to it."""
        assert all(d is not None for part in self._placed for d in part), "the average before every piece was placed"
        if out is None and not self.in_place:
            out = self.flat
        assert out is None or (out.shape == self.flat.shape and out.dtype == torch.float32 and out.is_contiguous())
        pieces = [bounds for part in self.pieces for bounds in part]
        encoded = [d for part in self._averaged for d in part]
        self._averaged = [[None] * len(p) for p in self.pieces]
        return CommittedAverage(self.codec.average, pieces, encoded, like, out)

    def ledger_entry(self) -> Entry:
        """Once the round committed: its ledger entry (p2p/ledger.py), built from the owners'
        declarations every member voted on, so the same on every member. A member's claim is the
        most it declared to any owner; its counted tokens, the least, capped, times its standing."""
        weights = self.audit.weights()
        claimed = [hi for _, hi in weights]
        counted = counted_weights([lo for lo, _ in weights], self.weight_cap, self.factors)
        scores = member_scores(total_gram(self.audit.grams(), len(self.members)), claimed)
        return build_entry(self.round + 1, self.members, claimed, counted, self.factors, scores, self.checks,
                           self.owners or ())

    # ---- waiting on the exchange -------------------------------------------------

    async def placed(self, index: int, k: int, deadline: float, *, failed_too: bool = False) -> None:
        """Return once piece ``k`` of part ``index`` is placed here. ``failed_too``: at once if it
        is, even when the attempt has failed since (its declaration can still be checked)."""
        if failed_too and self._placed[index][k] is not None:
            return
        await self._wait(lambda: self._placed[index][k] is not None, deadline)

    def digest(self) -> bytes:
        """The vote: ``digest`` of the whole averaged vector; every piece must have been placed."""
        pieces = [d for part in self._placed for d in part]
        assert all(d is not None for d in pieces), "digest before every averaged piece was placed"
        return digest(pieces, self.id)

    # ---- events ----------------------------------------------------------------

    def aborted_by(self, member: str, reason: str, culprit: object = None) -> None:
        """An abort from ``member``; it ends the attempt. Kept (to find who started it) unless
        this peer had failed for a reason of its own, which the others' aborts only answer —
        unless that failure came from ``member`` itself (it dropped our stream, then said why).
        ``culprit``: the index of the member it says it failed on, if it named one."""
        if self.failure is None or self.failure.reason == "aborted_by_peer" or self.failed_by == member:
            self.aborts.add(member, reason, culprit)
        self.fail("aborted_by_peer", reason)

    def culprit(self, reason: str) -> int | None:
        """The member this peer failed on, named in its abort (``aborted_by``'s ``culprit``): the
        one whose stream failed us, or whose input we refused; on a timeout, one we still wait
        for. None when the failure was about nobody else (our own, or an abort passed on)."""
        if self.failed_by is not None and self.failed_by in self.members:
            return self.members.index(self.failed_by)
        for peer in self.blame:
            if peer in self.members and peer != self.me:
                return self.members.index(peer)
        if reason != "timeout":
            return None
        others = [j for j in range(len(self.members)) if j != self.index]
        for j in others:  # an averaged part, an input to our own part, a vote not yet here
            if any(d is None for d in self._placed[j]):
                return j
        inputs = self.part.unreduced()
        if inputs is not None:
            return next((j for j in others if j not in inputs), None)
        return next((j for j in self.voters() if j != self.index and j not in self.votes), None)

    def mark(self, step: str) -> None:
        self.marks.setdefault(step, time.monotonic())

    def phases(self, grouped: float) -> dict[str, float]:
        """Seconds from ``grouped`` (when this peer joined the group) to the exchange's end, and
        from each marked step to the next: where an attempt's time went, for operators and for
        the round-trip count of docs/wan.md."""
        out, last = {}, grouped
        for step in ("exchanged", "audited", "voted"):
            if step in self.marks:
                out[step] = self.marks[step] - last
                last = self.marks[step]
        return out

    def fail(self, reason: str, detail: str = "", by: str | None = None) -> None:
        if self.failure is None:
            self.failure = RoundFailed(reason, detail)
            self.failed_by = by
            self._changed.set()

    def wake(self) -> None:
        """Something waited on may have changed (on the event loop's thread only)."""
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

    # ---- reduce: this peer owns part ``self.index`` (the inputs: ``part``) --------

    def set_reduced(self, k: int, data: bytes) -> None:
        self.part.set_reduced(k, data)
        self._changed.set()

    async def reduced_piece(self, k: int, deadline: float) -> tuple[bytes, bytes]:
        """The encoded average of piece ``k`` of our part and its declaration, once every member's
        piece ``k`` is in."""
        await self._wait(lambda: self.part.reduced[k] is not None, deadline)
        return self.part.reduced[k], self.part.declared[k]

    async def all_reduced(self, deadline: float) -> None:
        """Return once every piece of our part is averaged (and placed in our result)."""
        await self._wait(self.part.all_reduced, deadline)

    # ---- vote --------------------------------------------------------------------

    def add_vote(self, sender: int, value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != 16:
            raise RoundFailed("bad_vote")
        self.votes.setdefault(sender, value)
        self._changed.set()

    async def voted(self, index: int, deadline: float) -> bool:
        """Whether member ``index``'s vote is in, or comes in by ``deadline`` (False if not, or if
        the group failed meanwhile)."""
        try:
            await self._wait(lambda: index in self.votes, deadline)
        except RoundFailed:
            return False
        return True

    async def agreed(self, deadline: float) -> bool:
        """Whether the votes of every member of ``voters`` (in by ``deadline``) and ours are equal."""
        needed = self.voters()
        await self._wait(lambda: all(i in self.votes for i in needed), deadline)
        return len({self.votes[i] for i in [*needed, self.index]}) == 1

