"""Whom to leave out of rounds for a while: a pure decision over what peers did, time as a parameter.

Two kinds of offence. A *lie* — input no honest peer sends (a malformed or
non-finite piece, an impossible or capped weight, an owner's slice that an
audit recomputed differently, a misreported input) — quarantines the peer at
once. A *fault* — it aborted a round, refused a group, led a round it never
started while we saw a quorum ready, served a certificate whose signature fails,
or had more streams open to us than it may — could be bad luck, so it is a
strike, and ``strikes`` of them within the quarantine period quarantine it. One
pattern of faults is not bad luck: starting the aborts of two attempts in a row,
each naming nobody it failed on (``Quarantine.attempt_over``). An honest peer
aborts when something failed on its side, and says on whom: a member whose
stream broke, whose input it refused, that refused its group, or that it still
waited for at the deadline; the retry goes on without that member. An abort
that names nobody else is about the aborter itself; a peer that spoils the
retry that way too, with no attempt of ours committed in between, is
quarantined then (``aborted_again``). A quarantined peer is kept out of every
group this node leads and its ``begin`` is refused; it still counts as live in
the quorum (``quorum.py``) while it heartbeats, so quarantine can never let a
minority commit. Every node decides alone, from what it saw itself.
"""

from __future__ import annotations

from p2p.limits import BoundedDict

# Offences that only a lying (or broken) peer commits.
LIES = frozenset({
    "bad_payload", "bad_weight", "non_finite", "bad_size", "duplicate_part", "bad_lane", "weight_capped",
    "audit_failed", "owner_misreported", "bad_members", "bad_vote", "bad_evidence",
})
# Offences an honest peer may commit by bad luck (a leader whose begin was lost, whose view of
# the quorum was not ours): counted as strikes.
FAULTS = frozenset({"aborted", "refused", "silent_leader", "uncertified_state", "stream_flood"})
# Any other offence quarantines at once, like a lie: ``aborted_again`` (``attempt_over``).
STRIKES = 3
# Aborts that are nobody's offence: a member could not dial another. Over the internet a dial
# fails for reasons neither end controls (a lost SYN, a NAT, a route), and before p2pd dialled
# from ephemeral ports two peers dialling each other at once failed every time at 100-200 ms
# RTT: counted as aborts, that quarantined honest peers for 5 minutes. Such an abort leaves the
# aborter and the member it named out of the next attempt instead (``Conduct.judge``, p2p/conduct.py):
# a peer that claims it falsely sits the retry out with its target, and cannot stall rounds.
UNREACHABLE = "unreachable"


class Quarantine:
    """Per-peer strikes and quarantine periods, bounded in size."""

    def __init__(self, seconds: float, strikes: int = STRIKES, max_peers: int = 4096) -> None:
        self.seconds = seconds
        self.strikes = strikes
        self._until = BoundedDict(max_peers)  # peer -> end of its quarantine
        self._strikes = BoundedDict(max_peers)  # peer -> times of its recent faults
        # Who started the aborts of our last attempt, naming nobody, and when (None: it did not fail so).
        self._started_last: tuple[str, float] | None = None

    def attempt_over(self, starter: str | None, named_culprit: bool, now: float, reason: str = "") -> str | None:
        """One of our attempts ended at ``now``: ``starter`` started the aborts that failed it
        (None: it committed, or nobody's abort did) for ``reason``; ``named_culprit``: its abort
        named another member it failed on. The offence to count against the starter, if any:
        none for a failed dial (``UNREACHABLE``); ``aborted_again`` if it also started those of
        our attempt before, each time naming nobody, with no commit of ours between and within
        the quarantine period; else ``aborted``. An abort that names whom it failed on (a member
        that died, refused or lied) is a strike only: the retry goes on without that member."""
        if reason == UNREACHABLE and named_culprit:
            self._started_last = None
            return None
        unexplained = starter is not None and not named_culprit
        last = self._started_last
        again = unexplained and last is not None and last[0] == starter and now - last[1] < self.seconds
        self._started_last = (starter, now) if unexplained else None
        if starter is None:
            return None
        return "aborted_again" if again else "aborted"

    def offence(self, peer: str, reason: str, now: float) -> bool:
        """Record what ``peer`` did; True if this quarantines it (it was not quarantined before)."""
        if self.quarantined(peer, now):
            return False
        if reason in FAULTS:
            recent = [t for t in self._strikes.get(peer, ()) if now - t < self.seconds] + [now]
            self._strikes[peer] = recent[-self.strikes:]
            if len(recent) < self.strikes:
                return False
        self._strikes.pop(peer, None)
        self._until[peer] = now + self.seconds
        return True

    def quarantined(self, peer: str, now: float) -> bool:
        until = self._until.get(peer)
        if until is None:
            return False
        if until <= now:
            del self._until[peer]
            return False
        return True

    def active(self, now: float) -> set[str]:
        """Peers quarantined at ``now``."""
        return {p for p in list(self._until) if self.quarantined(p, now)}


class Refusals:
    """What peers told us of leaders they refuse (having quarantined them), each claim for the
    quarantine period it stands for, bounded in leaders and in claims per leader; and which
    leaders we already told the others about this round. ``quorum.shunned`` decides with it."""

    def __init__(self, seconds: float, max_leaders: int = 4096, max_claims: int = 1024) -> None:
        self.seconds = seconds
        self._claims = BoundedDict(max_leaders)  # leader -> BoundedDict(peer -> until)
        self._told = BoundedDict(max_leaders)  # leader -> (round, the peers told about it in that round)
        self._max_claims = max_claims
        self._max_leaders = max_leaders  # also the most peers told of one leader in one round

    def told_us(self, peer: str, leader: str, now: float) -> None:
        """``peer`` says it refuses ``leader``'s groups."""
        claims = self._claims.get(leader)
        if claims is None:
            claims = self._claims[leader] = BoundedDict(self._max_claims)
        claims[peer] = now + self.seconds

    def leaders(self) -> list[str]:
        """The leaders some peer told us it refuses."""
        return list(self._claims)

    def refusers(self, leader: str, now: float) -> list[str]:
        """The peers whose claim against ``leader`` still stands."""
        return [p for p, until in (self._claims.get(leader) or {}).items() if until > now]

    def to_tell(self, leader: str, round: int, peers) -> list[str]:
        """Which of ``peers`` we have not yet told in ``round`` that we refuse ``leader``: each
        hears it once a round, whichever of the leader's groups it was in."""
        told = self._told.get(leader)
        if told is None or told[0] != round:
            told = self._told[leader] = (round, set())
        fresh = [p for p in peers if p != leader and p not in told[1]][:self._max_leaders - len(told[1])]
        told[1].update(fresh)
        return fresh
