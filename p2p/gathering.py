"""Who is in a round, and who leads it: pure decisions over one look at the swarm.

A peer that waits for a group of round r looks at the swarm every poll
(``GroupFormation``, p2p/formation.py) and asks ``Gathering.decide(now, look)`` what to do:

- ``behind``: a majority of the others hold a newer round (``quorum.follow``; once the
  gather has waited ``gather_timeout``, enough of them to be one with us): re-sync;
- ``lead``: this peer leads the ready peers (``ready``, with ``owners``): its table is
  fresh (or it waited a whole gather), they are a quorum of the live peers
  (``quorum.can_start``), and nobody it groups with still trains or catches up from one
  round behind (or it waited long enough for them);
- ``leave_out``: the expected leader never started the round although we saw a quorum
  ready for long enough (``leader_wait_limit``, or ``all_in_wait_limit`` once nobody
  trains): the caller leaves it out for a while and counts a ``silent_leader`` strike;
- ``wait``: none of these (``reason`` says what is missing, for the log).

The ready peer with the smallest id leads, unless some ready peers are known to accept
dials and some are not: then those that are own the parts and the first of them leads
(``owners``), so members that may sit behind NAT never have to meet (docs/wan.md).

A member checks the leader's ``begin`` (``Proposal``): well formed, sent by the group's
leader, for a group of a strict majority of the peers *it* sees live, with its codec, its
vector size and its state.

Nothing here reads a clock or the network: time is ``now``, the swarm is a ``Look``,
so every rule can be tested without sleeping. A ``Gathering`` is one gather of one round;
its only state is since when it waits for which leader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p.failure import RoundFailed
from p2p.lanes import MAX_LANES
from p2p.ledger import Standing

# States of a peer one round behind that a gather waits for (as for a peer still training).
WAITED_BEHIND = ("joining", "checking")
from p2p.quorum import accept_group, can_start, follow, live_peers, quorum
from p2p.wire import WireError, field as hfield


@dataclass(frozen=True, slots=True)
class Look:
    """What one look at the swarm shows a gathering peer."""

    table: dict  # the peer table as read (peer -> PeerRecord, without this peer)
    grouping: dict  # the entries of the peers it would group with (``Conduct.grouping``)
    hinted: frozenset = frozenset()  # peers that told us directly they are ready for this round and state
    excluded: frozenset = frozenset()  # peers whose word on a state counts for nothing (``Conduct.not_vouching``)
    table_fresh: bool = True  # the last lookup succeeded (a stale table is not acted on alone)
    reachable: bool = False  # whether other peers can dial this one (its own check, p2p/reachability.py)


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do after one look (``action``, one of the module docstring's) and why."""

    action: str
    reason: str = ""
    leader: str = ""
    ready: list[str] = field(default_factory=list)  # the ready peers, this one included, sorted
    owners: list[str] | None = None  # for ``lead``: the members that own a part (None: all)
    training: list[str] = field(default_factory=list)  # peers we group with that still train this round


def dialable(peer: str, table: dict, me: str, reachable: bool) -> bool:
    """Whether ``peer`` is known to accept dials: its heartbeat says so (for us: our own check)."""
    if peer == me:
        return reachable
    record = table.get(peer)
    return record is not None and record.reachable is True


def owners(members, table: dict, me: str, reachable: bool) -> list[str] | None:
    """The members of a group that own a part (``Group.owners``): those known to accept dials,
    if there are at least two of them and some member is not one; None (all own) otherwise.
    The first of them leads. Members that may sit behind NAT then never have to meet:
    each only dials the owners, which reach it over the connections it opened."""
    found = sorted(m for m in set(members) if dialable(m, table, me, reachable))
    return found if 2 <= len(found) < len(set(members)) else None


def leader_of(members, table: dict, me: str, reachable: bool) -> str:
    """Who leads a group of ``members``: the first owner, or the smallest id if all own."""
    found = owners(members, table, me, reachable)
    return found[0] if found else min(members)


def expected_leader(me: str, round: int, peers: dict, ready, reachable: bool) -> str:
    """Whoever will lead ``round``: of the peers at (or about to reach) it, the first owner.
    Told directly that we are ready (a hint), it need not wait for its next table read."""
    members = [me, *ready, *(p for p, r in peers.items() if r.round >= round - 1 and r.state != "joining")]
    return leader_of(members, peers, me, reachable)


class Gathering:
    """One gather of round ``round`` by peer ``me``, begun at ``started``; see the module docstring."""

    def __init__(self, me: str, round: int, state: str, started: float, *, min_peers: int, gather_timeout: float,
                 request_timeout: float, heartbeat_interval: float) -> None:
        """``state``: the params_hash our pseudo-gradient was taken from; only peers announcing it
        are ready with us ("": not checked)."""
        self.me, self.round, self.state, self.started = me, round, state, started
        self.min_peers = min_peers
        self.gather_timeout = gather_timeout
        self.leader_wait_limit = gather_timeout + 2 * request_timeout
        # Once nobody we see is still training, an honest leader starts at its next look (one
        # begin round, a heartbeat or two for its table to show what ours does).
        self.all_in_wait_limit = 2 * request_timeout + 2 * heartbeat_interval
        self._waited_for: dict[str, float] = {}  # leader -> since when we wait for it
        self._all_in_since: dict[str, float] = {}  # leader -> since when we see a quorum ready and nobody training

    def decide(self, now: float, look: Look) -> Decision:
        me, round, state = self.me, self.round, self.state
        table, peers = look.table, look.grouping
        # Suspected and quarantined peers stay in the quorum's count while they heartbeat.
        live = live_peers(table, me)
        timed_out = now - self.started > self.gather_timeout
        why, _ = follow(table, me, (round, ""), excluded=look.excluded, patient=timed_out)
        if why == "behind":
            return Decision("behind", "swarm_ahead")
        hinted = {p for p in look.hinted if p in peers}
        ready = sorted({p for p, r in peers.items() if r.round == round and r.state == "ready"
                        and (not state or r.params_hash == state)} | hinted | {me})
        # Still training towards this round, or one round behind: catching up to it (a peer
        # that was left out of the last round, or a joiner; node/catchup.py), or checking a
        # member's update of the last round before its outer step (p2p/checks.py). Not
        # waited for, one whose catch-up takes longer than the others' inner steps would be
        # left out of every round and catch up forever (seen at 250 ms with 1-s inner phases).
        training = [p for p, r in peers.items() if p not in hinted and (
            (r.round == round and r.state == "training") or (r.round == round - 1 and r.state in WAITED_BEHIND))]
        leader = leader_of(ready, table, me, look.reachable)
        enough, short = can_start(ready, live, self.min_peers)
        waiting = short or f"{quorum(len(live), self.min_peers)} of {len(live)} live needed"

        def decision(action: str, reason: str = waiting, **extra) -> Decision:
            return Decision(action, reason, leader, ready, training=training, **extra)

        if leader == me:
            if (look.table_fresh or timed_out) and enough and (not training or timed_out):
                return decision("lead", "", owners=owners(ready, table, me, look.reachable))
            return decision("wait")
        if not enough:  # no quorum in our view either: nobody to blame
            self._waited_for.pop(leader, None)
            self._all_in_since.pop(leader, None)
            return decision("wait")
        first_seen = self._waited_for.setdefault(leader, now)
        if training:
            self._all_in_since.pop(leader, None)
            settled = 0.0
        else:
            settled = now - self._all_in_since.setdefault(leader, now)
        if now - first_seen > self.leader_wait_limit or settled > self.all_in_wait_limit:
            self._waited_for.pop(leader)
            self._all_in_since.pop(leader, None)
            return decision("leave_out", "silent_leader")
        return decision("wait")


@dataclass(frozen=True, slots=True)
class Proposal:
    """A leader's ``begin``: the group it proposes (``GroupFormation.lead`` sends it)."""

    round: int
    gid: bytes
    members: list[str]
    owners: list[str] | None  # the members that own a part (None: all); the first leads
    numel: int
    lanes: int
    codec: object  # the codec's name, as sent
    state: object  # the params_hash the members' pseudo-gradients come from, as sent
    standing: object  # ``Standing.digest`` of the members' weights in the leader's ledger, as sent

    @classmethod
    def parse(cls, sender: str, header: dict, me: str) -> "Proposal":
        """Checked for form: WireError if malformed, RoundFailed if ``sender`` is not the
        group's leader or ``me`` not a member."""
        round, members = hfield(header, "r", int), hfield(header, "members", list)
        gid, numel, lanes = hfield(header, "g", bytes), hfield(header, "numel", int), hfield(header, "lanes", int)
        if not 1 <= lanes <= MAX_LANES:
            raise WireError("bad_field", "lanes")
        if not all(isinstance(m, str) for m in members) or members != sorted(set(members)):
            raise WireError("bad_members")
        owners = header.get("owners")
        if owners is not None and not (isinstance(owners, list) and all(isinstance(m, str) for m in owners)
                                       and owners == sorted(set(owners)) and set(owners) <= set(members)
                                       and 2 <= len(owners) < len(members)):
            raise WireError("bad_field", "owners")
        if sender != (owners or members)[0] or me not in members:
            raise RoundFailed("not_a_member")
        return cls(round, gid, members, owners, numel, lanes, header.get("codec"), header.get("h"), header.get("sd"))

    def refusal(self, *, numel: int, state: str, codec: str, live: set[str], min_peers: int,
                standing: Standing | None = None) -> str:
        """Why a member waiting in this round with ``numel`` values from ``state`` ("": not
        checked), with ``codec``, seeing ``live`` peers, its ledger's ``standing`` (None: not
        checked), refuses the group ("": it accepts). A vector of another size is a lie
        (RoundFailed ``bad_size``)."""
        if self.numel != numel:
            raise RoundFailed("bad_size")
        ok, reason = accept_group(self.members, live, min_peers)
        if not ok:  # a leader with a stale table, or one that lies, cannot make us commit as a minority
            return reason
        if self.codec != codec:
            return "codec_mismatch"
        if state and self.state != state:  # another lineage of this round number
            return "state_mismatch"
        if standing is not None:
            if standing.left_out() & set(self.members):
                return "left_out_by_ledger"
            if self.standing != standing.digest(self.members):  # the members' weights would differ
                return "standing_mismatch"
        return ""
