"""Checks: members chosen by a beacon test sampled members' updates against their assigned data.

The Gram scores (p2p/scores.py) see what an input looks like next to the others'; they
cannot tell an update trained on other data than the member's own (``shirk``), or last
round's update sent again (``replay``), from honest work. A check can (Templar's Gauntlet,
arXiv 2505.21684, among the peers themselves):

- **Who.** After round r commits, its ledger entry's digest is the *beacon*: it covers every
  member's input hashes and scores, so no member knows it before all inputs were sent, and
  every member computes the same one. It orders the members that own a part (dialable ones;
  ``assignments``); the first CHECKED are *sampled*, each checked by the CHECKERS members after
  it in that order.
- **What.** Every member keeps the encoded pieces it sent in round r until the next commit
  (one encoded copy of its vector: 1/85 of fp32 with the sparse codec). A checker fetches the
  sampled member's (``input`` requests, the checker only), checks every piece against the
  owners' declarations (the hash every member voted on) and decodes it: u, what the owners
  averaged. It measures (trainer/check.py) the loss of θ − u on the last CHECK_WINDOWS
  windows the member's token claim says it trained (its stream, trainer/data.py
  ``stream_windows``), on the checker's own last CHECK_WINDOWS and on CHECK_WINDOWS other
  training windows chosen by the beacon, and the same of its own update θ − u' (once a round
  for all its checks), and of θ on the control windows: the ``gains``.
- **Verdict** (``judge``, a pure function of the gains, checked by every receiver):
  *unassigned* when the member's model is not better on its own windows, against the checker's,
  than it is on any windows, by at least UNASSIGNED of what the checker's model is on the
  checker's windows (it did not learn its windows: trained on other data, a replay, no work or
  noise); *withheld* when the member does not hand its input over.
- **Record.** The checker signs a ``CheckRecord`` and sends it to every live peer. A leader puts
  the records it holds into its next proposal; every member checks each (signature, the
  beacon's assignment, the verdict from the gains) before it accepts the group, and the
  round's ledger entry carries them, so the commit certificate covers them. A sampled member
  counts as flagged for round r (p2p/ledger.py ``Standing``) only when *every* one of its
  checkers flagged it: one lying checker cannot frame an honest member.

Cost per round: CHECKED x CHECKERS fetches of one member's encoded vector (sparse at 70B: 3.3 GB
each, against 3.3 GB each way of the all-reduce) and, per check, one load of θ − u into the
model and 3 x CHECK_WINDOWS windows of forward passes; per checker and round, two more loads
(θ − u', θ) and (3 + checks) x CHECK_WINDOWS windows. Checks need the local copy
free at the round boundary: single-rank hosts without overlap (docs/ledger.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

import msgpack
import torch

from p2p.digests import DECLARED, input_hash
from p2p.limits import BoundedDict
from p2p.quorum import live_peers
from p2p.records import peer_id_of_public_key, verify_rsa
from p2p.wire import WireError, field as hfield, reply, write_frame

log = logging.getLogger(__name__)

CHECKED = 2  # members sampled each round by default (swarm.checked_members)
CHECKERS = 2  # checkers of each sampled member
MIN_CHECKED_GROUP = 3  # smaller groups are not checked (p2p/ledger.py MIN_JUDGED)
CHECK_WINDOWS = 32  # windows of each kind a check evaluates
UNASSIGNED = 0.25
MIN_ADVANTAGE = 0.5
CHECK_FLAGS = ("unassigned", "withheld")
MAX_CHECKS_PER_ENTRY = 16
INPUT_PIECES = 16  # pieces per ``input`` request
FETCH_SECONDS = 600.0  # the most a checker spends fetching one input
MIN_FETCH_RATE = 1e6  # bytes/s a member sending its input must keep up, or it withheld it
_KEY_BYTES, _SIGNATURE_BYTES = 1024, 1024


def _order(beacon: bytes, members: list[str]) -> list[str]:
    return sorted(members, key=lambda m: hashlib.sha256(beacon + m.encode()).digest())


def checkers_of(beacon: bytes, members: list[str], sampled: str) -> tuple[str, ...]:
    """Who checks ``sampled`` if the beacon samples it: the CHECKERS members after it in the
    beacon's order."""
    order = _order(beacon, members)
    i = order.index(sampled)
    return tuple(order[(i + 1 + j) % len(order)] for j in range(min(CHECKERS, len(order) - 1)))


def assignments(beacon: bytes, members: list[str], owners: list[str] | None = None,
                checked: int = CHECKED, veterans: set[str] | None = None) -> dict[str, tuple[str, ...]]:
    """Sampled member -> its checkers, for a round whose entry digest is ``beacon``: the first
    ``checked`` members that own a part (a member that owns none may not be dialable) and were
    members of the round before (``veterans``; None: all were) in the beacon's order; any member
    checks. A member's first round after it joined is not checked: its inner optimizer starts
    afresh (learning-rate warmup), and its update is small for an honest reason."""
    if len(members) < MIN_CHECKED_GROUP:
        return {}
    eligible = set(owners or members) & (set(members) if veterans is None else veterans)
    sampled = [p for p in _order(beacon, members) if p in eligible][:checked]
    return {p: checkers_of(beacon, members, p) for p in sampled}


GAINS = 7  # the losses a check records (``judge``)


def judge(gains: tuple[float, ...]) -> tuple[str, ...]:
    """The verdict of a check from its ``gains``: the mean losses of the member's model θ − u on
    the member's windows A, the checker's own windows B and the control windows C, of the
    checker's θ − u' on A, B and C, and of θ on C; () measured nothing (the member withheld).

    Every comparison is on the same windows, so what a window costs any model cancels, and
    so does how far each update got in general (a slow host's update got less far):

    - the member's *advantage* on its windows: how much more the loss of its model is below
      the checker's on A than on C (the checker never saw A: A is to it like any data);
    - the *reference*: the same of the checker's model against the member's on B.

    *Unassigned*: the advantage is below UNASSIGNED of the reference, or the member's model does
    worse on its own windows than the checker's, which never saw them, by more than that (it
    trained on other data, sent an old update or none, or noise; a slow host's model may be a
    little worse there: it got less far in general). Only when the reference shows what it
    tests: positive and at least MIN_ADVANTAGE of the checker's general gain on C in size. In a
    run's first rounds an update learns what all windows share, and a window's own share is lost
    in the noise (measured: ``scripts/bench.py checks``, docs/ledger.md)."""
    if not gains:
        return ("withheld",)
    m_a, m_b, m_c, c_a, c_b, c_c, base_c = gains
    advantage = (m_c - m_a) - (c_c - c_a)
    reference = (c_c - c_b) - (m_c - m_b)
    if reference <= 0 or reference < MIN_ADVANTAGE * abs(base_c - c_c):
        return ()
    if advantage < UNASSIGNED * reference or m_a - c_a > UNASSIGNED * reference:
        return ("unassigned",)
    return ()


@dataclass(frozen=True, slots=True)
class CheckRecord:
    """A checker's signed word on one sampled member's update of one round."""

    scope: str
    round: int  # the round the update went into (its commit's number)
    sampled: str
    checker: str
    gains: tuple[float, ...]  # GAINS losses (``judge``); () if withheld
    public_key: bytes
    signature: bytes

    @property
    def flags(self) -> tuple[str, ...]:
        return judge(self.gains)

    @property
    def key(self) -> tuple[int, str, str]:
        return self.round, self.sampled, self.checker

    def message(self) -> bytes:
        return signed_message(self.scope, self.round, self.sampled, self.checker, self.gains)

    def to_wire(self) -> list:
        return [self.scope, self.round, self.sampled, self.checker, list(self.gains), self.public_key, self.signature]

    @classmethod
    def from_wire(cls, value) -> "CheckRecord":
        """Parse and verify (signature by the checker's own key); ValueError("bad_check") if not."""
        if not (isinstance(value, list) and len(value) == 7):
            raise ValueError("bad_check")
        scope, rnd, sampled, checker, gains, public_key, signature = value
        if not (isinstance(scope, str) and len(scope) <= 256 and isinstance(rnd, int) and not isinstance(rnd, bool)
                and 0 < rnd < 2**53 and all(isinstance(p, str) and 0 < len(p) <= 128 for p in (sampled, checker))
                and sampled != checker and isinstance(gains, list) and len(gains) in (0, GAINS)
                and all(isinstance(g, float) and math.isfinite(g) for g in gains)
                and isinstance(public_key, bytes) and len(public_key) <= _KEY_BYTES
                and isinstance(signature, bytes) and len(signature) <= _SIGNATURE_BYTES):
            raise ValueError("bad_check")
        record = cls(scope, rnd, sampled, checker, tuple(gains), public_key, signature)
        if peer_id_of_public_key(public_key) != checker or not verify_rsa(public_key, record.message(), signature):
            raise ValueError("bad_check")
        return record


def signed_message(scope: str, round: int, sampled: str, checker: str, gains: tuple[float, ...]) -> bytes:
    return msgpack.packb(["gonka-check", scope, round, sampled, checker, list(gains)])


def checkers_by_entry(lookup: Callable) -> Callable[[int, str], tuple[str, ...] | None]:
    """``checkers(round, sampled)`` for ``failed``: whom the beacon of that round's entry
    (``lookup(round)``, None if unknown) would name to check ``sampled``."""
    def checkers(round: int, sampled: str) -> tuple[str, ...] | None:
        entry = lookup(round)
        if entry is None or sampled not in entry.members:
            return None
        return checkers_of(entry.digest(), list(entry.members), sampled)

    return checkers


def failed(records: Iterable[CheckRecord], checkers: Callable[[int, str], tuple[str, ...] | None]
           ) -> set[tuple[str, int]]:
    """(sampled, round) of every check whose assigned checkers (``checkers(round, sampled)``; None:
    unknown) all flagged it in ``records``."""
    flagged: dict[tuple[str, int], set[str]] = {}
    for r in records:
        if r.flags:
            flagged.setdefault((r.sampled, r.round), set()).add(r.checker)
    out = set()
    for (sampled, rnd), by in flagged.items():
        assigned = checkers(rnd, sampled)
        if assigned and set(assigned) <= by:
            out.add((sampled, rnd))
    return out


def judged(gains: tuple[float, ...]) -> bool:
    """Whether a check's reference was strong enough for a verdict (``judge`` did not abstain):
    the same gains with the member's model as poor as can be are flagged."""
    return bool(gains) and bool(judge((math.inf, *gains[1:])))


@dataclass(eq=False)
class _Retained:
    """What this member keeps of its last committed round for checks."""

    round: int
    members: list[str]
    pieces: list[list[tuple[int, int]]]
    declared: list[list[bytes]]  # the owners' declarations of every piece (input hashes)
    sent: dict[tuple[int, int], bytes]  # our encoded pieces as the owners got them
    codec: object
    numel: int
    assigned: dict[str, tuple[str, ...]]
    fetches: dict[str, asyncio.Task]


class CheckBook:
    """This node's part in checks: its last round's input kept for checkers, the fetches of the
    inputs it checks, and the records it holds until a round's entry carries them."""

    def __init__(self, swarm, commits, call: Callable[..., Awaitable], metrics, checked: int = CHECKED,
                 request_timeout: float = 20.0) -> None:
        """``checked``: members sampled each round (``swarm.checked_members``, the same in the
        whole run: it is part of the fingerprint). ``request_timeout``: how long a member may
        take to answer one request for its input (plus the transfer at MIN_FETCH_RATE)."""
        self.swarm = swarm
        self.checked = checked
        self.request_timeout = request_timeout
        self.commits = commits  # p2p/commits.py CommitLog: the entries a record is checked against
        self._call = call
        self.metrics = metrics
        self.last: _Retained | None = None
        self.pending: BoundedDict = BoundedDict(256)  # record key -> CheckRecord, not yet in an entry

    # ---- our side: what we keep, whom we check ----------------------------------------

    def committed(self, group, entry) -> None:
        """Round ``entry.round`` committed with ``group``: keep what we sent, and start fetching
        the inputs of the members we check (they may be gone by the next commit)."""
        if self.last is not None:
            for task in self.last.fetches.values():
                task.cancel()
        assigned = assignments(entry.digest(), group.members, group.owners, self.checked, self._veterans(entry.round))
        self.last = _Retained(entry.round, list(group.members), group.pieces,
                              [[d for d in part] for part in group.audit.declared], group.kept, group.codec,
                              group.flat.numel(), assigned, {})
        me = self.swarm.peer_id
        for sampled, checkers in assigned.items():
            if me in checkers:
                self.last.fetches[sampled] = asyncio.ensure_future(self._fetch(self.last, sampled))

    def tasks(self) -> list[str]:
        """The members whose last-round update this node checks."""
        return [] if self.last is None else list(self.last.fetches)

    def claimed(self, peer: str) -> float:
        """``peer``'s claimed tokens in our last committed round (its ledger row)."""
        entry = self.commits.entries.get(self.last.round)
        return next((row.claimed for row in entry.rows if row.peer == peer), 0.0) if entry else 0.0

    @property
    def beacon(self) -> bytes:
        return self.commits.entries[self.last.round].digest()

    async def fetched(self, sampled: str) -> torch.Tensor | None:
        """The sampled member's update (decoded), None if it withheld it."""
        try:
            return await self.last.fetches[sampled]
        except (asyncio.CancelledError, KeyError):
            return None

    def own_update(self) -> torch.Tensor:
        """Our own update of the last round, as the owners decoded it."""
        last = self.last
        out = torch.empty(last.numel, dtype=torch.float32)
        for j, part in enumerate(last.pieces):
            for k, (start, end) in enumerate(part):
                out[start:end] = last.codec.decode(last.sent[(j, k)], end - start)
        return out

    async def _fetch(self, last: _Retained, sampled: str) -> torch.Tensor | None:
        index = last.members.index(sampled)
        out = torch.empty(last.numel, dtype=torch.float32)
        deadline = time.monotonic() + FETCH_SECONDS
        try:
            for j, part in enumerate(last.pieces):
                for k0 in range(0, len(part), INPUT_PIECES):
                    ks = range(k0, min(k0 + INPUT_PIECES, len(part)))
                    sizes = [last.codec.wire_bytes(part[k][1] - part[k][0]) for k in ks]
                    # A member that stopped answering costs one request's time, not the budget:
                    # its checkers wait for it before their outer steps.
                    timeout = min(self.request_timeout + sum(sizes) / MIN_FETCH_RATE,
                                  max(1.0, deadline - time.monotonic()))
                    request = {"r": last.round, "j": j, "k": k0, "n": len(ks)}
                    ready_by = time.monotonic() + 2 * self.request_timeout
                    while True:
                        header, payload = await self._call(sampled, "input", request, timeout, sum(sizes))
                        # It has not taken its own commit in yet: a moment.
                        if header.get("reason") != "not_ready" or time.monotonic() > ready_by:
                            break
                        await asyncio.sleep(0.2)
                    if not header.get("ok") or len(payload) != sum(sizes):
                        raise ValueError(str(header.get("reason", "refused"))[:40])
                    offset = 0
                    for k, size in zip(ks, sizes):
                        piece = payload[offset:offset + size]
                        offset += size
                        _, hashed = DECLARED.unpack_from(last.declared[j][k], DECLARED.size * index)
                        if input_hash(piece) != hashed:  # not what the owners averaged
                            self.swarm.reject("bad_check", f"input of {sampled[-8:]}")
                            raise ValueError("not_declared")
                        start, end = part[k]
                        out[start:end] = last.codec.decode(piece, end - start)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.info("check of %s, round %d: no input (%s)", sampled[-8:], last.round, str(e)[:60])
            return None
        return out

    def sign(self, sampled: str, gains: tuple[float, ...]) -> CheckRecord:
        signer = self.swarm.signer
        me = self.swarm.peer_id
        message = signed_message(self.swarm.scope, self.last.round, sampled, me, gains)
        return CheckRecord(self.swarm.scope, self.last.round, sampled, me, gains, signer.public_key,
                           signer.sign(message))

    async def publish(self, record: CheckRecord) -> None:
        """Keep our record and send it to every live peer (best effort: the leader of a later
        round needs it, and any of them may lead)."""
        self.add(record)
        others = sorted(live_peers(self.swarm.peers, self.swarm.peer_id) - {self.swarm.peer_id})
        await asyncio.gather(*(self._call(p, "check", {"c": record.to_wire()}) for p in others),
                             return_exceptions=True)

    # ---- records: validated, held, proposed, accepted ---------------------------------------

    def checkers(self, round: int, sampled: str) -> tuple[str, ...] | None:
        """Whom the beacon of ``round`` (its entry, if we hold it) chose to check ``sampled``."""
        entry = self.commits.entries.get(round)
        if entry is None:
            return None
        return assignments(entry.digest(), list(entry.members), list(entry.owners) or None,
                           self.checked, self._veterans(round)).get(sampled)

    def _veterans(self, round: int) -> set[str]:
        """The members of the round before ``round`` (none known: nobody is checked)."""
        before = self.commits.entries.get(round - 1)
        return set(before.members) if before is not None else set()

    def valid(self, record: CheckRecord) -> str:
        """Why ``record`` (signature already verified) is not one to keep, "" if it is."""
        if record.scope != self.swarm.scope:
            return "other run"
        checkers = self.checkers(record.round, record.sampled)
        if checkers is None or record.checker not in checkers:
            return "not assigned"
        return ""

    def add(self, record: CheckRecord) -> str:
        why = self.valid(record)
        if not why and not self._included(record.key):
            self.pending[record.key] = record
        return why

    def _included(self, key) -> bool:
        return any(r.key == key for e in self.commits.entries.values() for r in e.checks)

    def for_proposal(self) -> list:
        """The records a leader puts into its proposal: held, valid, not in an entry yet."""
        self.pending.retain(lambda key, r: not self._included(key) and not self.valid(r))
        records = sorted(self.pending.values(), key=lambda r: r.key)[:MAX_CHECKS_PER_ENTRY]
        return [r.to_wire() for r in records]

    def accept(self, wires) -> list[CheckRecord]:
        """The records of a leader's proposal, each checked; ValueError if any is not acceptable."""
        if not isinstance(wires, list) or len(wires) > MAX_CHECKS_PER_ENTRY:
            raise ValueError("bad_check")
        records = [CheckRecord.from_wire(w) for w in wires]
        if len({r.key for r in records}) != len(records):
            raise ValueError("bad_check")
        for r in records:
            if self.valid(r) or self._included(r.key):
                raise ValueError("bad_check")
        return records

    # ---- requests in -----------------------------------------------------------------------

    async def on_input(self, sender: str, header: dict, reader, writer) -> None:
        """A checker asks for our pieces of one part of the round we last committed."""
        rnd, j, k0, n = (hfield(header, f, int) for f in ("r", "j", "k", "n"))
        last = self.last
        if last is None or rnd > last.round:
            await reply(writer, {"ok": False, "reason": "not_ready"})
            return
        if (rnd != last.round or sender not in
                next((c for s, c in last.assigned.items() if s == self.swarm.peer_id), ())):
            await reply(writer, {"ok": False, "reason": "not_checker"})
            return
        if not (0 <= j < len(last.pieces) and 0 <= k0 and 0 < n <= INPUT_PIECES and k0 + n <= len(last.pieces[j])):
            raise WireError("bad_field", "input pieces")
        payload = b"".join(last.sent[(j, k)] for k in range(k0, k0 + n))
        self.metrics.sent_bytes.inc(await write_frame(writer, {"ok": True}, payload))

    async def on_check(self, sender: str, header: dict, reader, writer) -> None:
        """A checker's record."""
        try:
            record = CheckRecord.from_wire(header.get("c"))
        except ValueError:
            self.swarm.reject("bad_check", sender[-8:])
            await reply(writer, {"ok": False, "reason": "bad_check"})
            return
        why = self.add(record)
        await reply(writer, {"ok": not why, **({"reason": why} if why else {})})
