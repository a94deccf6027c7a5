"""This node's judgement of the others' conduct, and whom it leaves out of its groups for it.

``RoundProtocol`` owns one ``Conduct`` and reports to it what peers did: an offence
(``offence``: a lie quarantines at once, a fault is a strike, p2p/quarantine.py), the end
of an attempt (``judge``: whom it blames, who started the aborts), a flood of streams
(``flooded_by``), a state that showed no certificate chain (``unverified``). It asks back
whom to group with (``grouping``: neither suspected, quarantined nor shunned) and whose
word on a state counts (``not_vouching``). Once this node quarantines a peer it tells the
others, each once a round, that it refuses that peer's groups (``tell_refused``); what
peers tell us of the leaders they refuse (``told_us``) makes a leader *shunned* once
enough of them do (``quorum.shunned``).

*Suspects* are peers left out of our next attempts for a few seconds without blame (one
that did not answer a ``begin``, a leader that never started its round, a member we could
not dial). None of this touches the quorum's count (p2p/quorum.py): a suspected or
quarantined peer stays live while it heartbeats. Every node decides alone, from what it
saw itself; time is ``time.monotonic``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from p2p.failure import RoundFailed
from p2p.group import Group
from p2p.limits import BoundedDict
from p2p.quarantine import UNREACHABLE, Quarantine, Refusals
from p2p.quorum import live_peers, shunned
from p2p.wire import WireError

# The round protocol's log: scripts/attack.py reads "p2p.rounds: quarantined peer ..." lines.
log = logging.getLogger("p2p.rounds")


class Conduct:
    """Quarantine, refusals, suspects and unvouched states of one node; see the module docstring."""

    def __init__(self, swarm, metrics, *, tell: Callable[[str, str], Awaitable],
                 background: Callable[[Awaitable], None]) -> None:
        """``swarm``: read for this peer's id, round and peer table. ``tell(peer, leader)``: tell
        ``peer`` that we refuse ``leader``'s groups (a request; may fail). ``background(call)``:
        run a best-effort request without waiting for it."""
        cfg = swarm.config
        self.swarm = swarm
        self.metrics = metrics
        self.min_peers = cfg.min_peers
        # Out of our next attempts for a while, without blame: a few heartbeats, enough for the
        # table to show whether the peer is still there.
        self.suspect_seconds = 3 * cfg.heartbeat_interval
        self.quarantine = Quarantine(cfg.quarantine_seconds)
        # Leaders that peers told us they refuse (they quarantined it); see ``quorum.shunned``.
        self.refusals = Refusals(cfg.quarantine_seconds)
        self.suspects: BoundedDict = BoundedDict(4096)  # peer -> until when
        self._floods: BoundedDict = BoundedDict(4096)  # peer -> when its last flood strike was given
        # Peers that announced a state which showed us no certificate chain: peer -> (that
        # params_hash, until when). See ``not_vouching``.
        self._unverified: BoundedDict = BoundedDict(4096)
        self._tell = tell
        self._background = background

    # ---- whom to group with, whose word counts ------------------------------------

    def suspect(self, peer: str, seconds: float | None = None) -> None:
        """Leave ``peer`` out of our attempts for ``seconds`` (default ``suspect_seconds``)."""
        self.suspects[peer] = time.monotonic() + (self.suspect_seconds if seconds is None else seconds)

    def grouping(self, peers) -> dict:
        """The peers this node would group with: neither suspected, quarantined, nor shunned
        (enough peers refuse its groups that it cannot lead one that commits: waiting for it
        to lead would only stall the round)."""
        now = time.monotonic()
        self.suspects.retain(lambda p, t: t > now)
        out = self.quarantine.active(now) | self.shunned(peers, now)
        return {p: r for p, r in peers.items() if p not in self.suspects and p not in out}

    def shunned(self, peers, now: float) -> set[str]:
        """The live leaders that enough live peers refuse that none of their groups can commit."""
        live = live_peers(peers, self.swarm.peer_id)
        return {leader for leader in self.refusals.leaders() if leader in live
                and shunned(self.refusals.refusers(leader, now), live, self.min_peers)}

    def unverified(self, peer: str, params_hash: str) -> None:
        """``peer`` announced ``params_hash`` and no donor of it showed a certificate chain to it."""
        self._unverified[peer] = (params_hash, time.monotonic() + self.quarantine.seconds)

    def not_vouching(self, peers, now: float) -> set[str]:
        """Peers whose word on which state to follow counts for nothing now (``quorum.follow``'s
        ``excluded``; they still count as live): the quarantined, and those still announcing a
        state that showed us no certificate chain. Without the second, two peers announcing
        uncertifiable newer states kept three honest ones re-syncing in vain, announced as
        joining (so not live); the two then were a majority of the live and ran ahead alone."""
        self._unverified.retain(lambda p, v: v[1] > now)
        return self.quarantine.active(now) | {p for p, (h, _) in self._unverified.items()
                                              if p in peers and peers[p].params_hash == h}

    # ---- what peers did ------------------------------------------------------------

    def offence(self, peer: str, reason: str) -> None:
        """Record what a peer did (p2p/quarantine.py); count and log a new quarantine."""
        if peer != self.swarm.peer_id and self.quarantine.offence(peer, reason, time.monotonic()):
            # Every peer hears at once that we refuse its groups now, not only the members of the
            # next group it leads (they accept that begin before our word reaches them), and not
            # only the live ones: one still joining is live in a moment, and would not hear it.
            self.tell_refused(peer, self.swarm.round, self.swarm.peers)
            self.metrics.quarantined.labels(reason=reason).inc()
            self.metrics.quarantined_peers.set(len(self.quarantine.active(time.monotonic())))
            log.warning("quarantined peer %s for %.0fs: %s", peer[-8:], self.quarantine.seconds, reason)

    def flooded_by(self, peer: str) -> None:
        """``peer`` has as many streams open to us as it may: a peer we cannot even hear out is no
        member to group with. A strike, at most one a second (a flood is many refusals at once;
        an honest peer that a slow moment piled up gets one), and out of our groups for a while."""
        now = time.monotonic()
        last = self._floods.get(peer)
        if last is None or now - last >= 1.0:
            self._floods[peer] = now
            self.suspect(peer)
            self.offence(peer, "stream_flood")

    def judge(self, group: Group) -> list[str]:
        """After an attempt: the members whose input (or output, as owners) this peer refused,
        and whoever started the aborts it got (a strike; quarantine if it started those of our
        attempt before too: ``Quarantine.attempt_over``). Returns them."""
        blamed = dict(group.blame)
        starter = group.aborts.starter()
        reason = group.aborts.reason(starter)
        culprit = group.aborts.named(starter)
        offence = self.quarantine.attempt_over(starter, culprit is not None, time.monotonic(), reason)
        if reason == UNREACHABLE and culprit is not None:  # p2p/quarantine.py: out of the retry, both
            for peer in (starter, culprit):
                if peer != self.swarm.peer_id:
                    self.suspect(peer)
        elif group.failure is not None and group.failure.reason == UNREACHABLE and group.failed_by is not None:
            self.suspect(group.failed_by)  # we could not dial it
        if offence is not None:
            blamed.setdefault(starter, offence)
        for peer, what in blamed.items():
            self.offence(peer, what)
        return sorted(blamed)

    # ---- refusals, told and heard ----------------------------------------------------

    def tell_refused(self, leader: str, round: int, peers) -> None:
        """We refuse ``leader``'s groups (quarantined): tell ``peers`` (each once a round), so that
        they stop joining them once enough of us do (``shunned``)."""
        async def tell(peer: str) -> None:  # a few tries: a busy moment must not cost the round its word
            for attempt in range(3):
                try:
                    await self._tell(peer, leader)
                    return
                except (RoundFailed, WireError, OSError, asyncio.IncompleteReadError) as e:
                    log.debug("telling %s that we refuse %s failed: %r", peer[-8:], leader[-8:], e)
                    await asyncio.sleep(0.5 * (attempt + 1))

        for peer in self.refusals.to_tell(leader, round, [p for p in peers if p != self.swarm.peer_id]):
            self._background(tell(peer))

    def told_us(self, peer: str, leader: str) -> None:
        """``peer`` says it refuses ``leader``'s groups (over its own authenticated stream)."""
        self.refusals.told_us(peer, leader, time.monotonic())
