"""How this peer gets into a group for a round: it waits, gathers, leads or accepts.

``RoundProtocol.average`` asks ``GroupFormation.form`` for a group and runs the
round in it; this class carries out the handshake that comes first:

- the wait: the input this peer waits with (``Wait``), announced ``ready``;
- ready hints: a waiting peer tells the peer it expects to lead directly
  (``ready``), so the leader need not wait for its next DHT poll to see it;
- the gather: every ``POLL_SECONDS`` (or at once when a hint comes in) a look
  at the swarm, and ``Gathering.decide`` (p2p/gathering.py, pure) says whether
  to wait, lead, leave a silent leader out, or fall ``Behind``;
- the leader's ``begin`` (``lead``): every member must accept, else the attempt
  is called off and the gather goes on without the silent ones;
- a member's answer to a ``begin`` (``on_begin``): ``Proposal.refusal`` over its
  own view, after ``Conduct`` had its say about the sender.

What it needs of its owner is handed in: the swarm, this host's shard plane
(groups are made and installed there), ``Conduct``, ``VoteExchange`` (to call a
refused attempt off), reachability, metrics, a request sender and a runner of
best-effort requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import torch

from p2p.gathering import Gathering, Look, Proposal, expected_leader
from p2p.group import Group
from p2p.lanes import lanes_for_rtt
from p2p.ledger import Standing
from p2p.limits import BoundedDict
from p2p.quorum import live_peers
from p2p.wire import WireError, field as hfield, reply

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
WAIT_REPORT_SECONDS = 15.0  # how often a long gather says what it is waiting for


class Behind(Exception):
    """The swarm is past this peer's round: it re-syncs instead of averaging."""


@dataclass(eq=False)
class Wait:
    """This peer's wait for a group of ``round``, with the input it will average."""

    round: int
    flat: torch.Tensor
    weight: float
    group: asyncio.Future
    state: str = ""  # params_hash of the state the pseudo-gradient was taken from ("": not checked)
    donated: bool = False  # ``flat`` is the caller's vector, the residual added once (``RoundProtocol.average``)


class GroupFormation:
    """``form(wait)``: the group this peer averages in; see the module docstring."""

    def __init__(self, swarm, plane, conduct, votes, reachability, metrics, *,
                 call: Callable[..., Awaitable], background: Callable[[Awaitable], None],
                 standing: Callable[[int], Standing] = lambda round: Standing(()), checks=None) -> None:
        """``standing(round)``: what the ledger's last entries up to ``round`` say of each peer
        (p2p/ledger.py): its weight in the group, or that it is left out. ``checks``: the
        check records a leader proposes and a member accepts (p2p/checks.py ``CheckBook``)."""
        cfg = swarm.config
        self.swarm = swarm
        self.plane = plane  # p2p/shard.py: makes, installs and leaves the groups
        self.conduct = conduct
        self.votes = votes
        self.reachability = reachability
        self.metrics = metrics
        self._call = call  # (peer, request name, header) -> (reply header, payload)
        self.standing = standing
        self.checks = checks
        self._background = background
        self.min_peers = cfg.min_peers
        self.gather_timeout = cfg.gather_timeout
        self.request_timeout = cfg.request_timeout
        self.waiting: Wait | None = None
        self._waiting_set = asyncio.Event()  # set whenever a new wait for a group starts
        # Peers that told us directly they are ready for a round (peer -> (round, state)).
        self.hints: BoundedDict = BoundedDict(4096)
        # Wakes a gather before its next poll: a hint came in, or a group was installed.
        self._wake = asyncio.Event()

    async def form(self, wait: Wait, started: float) -> Group:
        """Wait with ``wait`` until this peer is in a group of its round (``Behind`` if the swarm
        is past it)."""
        self._set(wait)
        self.swarm.announce(state="ready", round=wait.round)
        try:
            return await self._gather(wait.round, started)
        finally:
            self.waiting = None

    def _set(self, wait: Wait) -> None:
        self.waiting = wait
        self._waiting_set.set()

    # ---- gather: who is in this round (the decisions: p2p/gathering.py) ---------------

    async def _gather(self, round: int, started: float) -> Group:
        state = self.waiting.state
        cfg = self.swarm.config
        gathering = Gathering(self.swarm.peer_id, round, state, started, min_peers=self.min_peers,
                              gather_timeout=self.gather_timeout, request_timeout=self.request_timeout,
                              heartbeat_interval=cfg.heartbeat_interval)
        reported = started
        self.hints.retain(lambda p, r: r[0] >= round)
        # Hint at once from the last table read; the fresh read below corrects the guess if needed.
        left_out = self.standing(round).left_out()
        # Left out ourselves, we lead nothing: the others group without us and move on, and we
        # follow them (behind) until our flags age out of the ledger's window.
        benched = self.swarm.peer_id in left_out
        left_out = left_out - {self.swarm.peer_id}
        hinted_to = self._hint_leader(self._grouping(self.swarm.peers, left_out), round, None)
        woken = False
        while True:
            # Woken by a peer's hint: the table read a moment ago is fresh enough.
            table = await self.swarm.refresh_peers(max_age=POLL_SECONDS if woken else 0.0)
            now = time.monotonic()
            look = Look(table, self._grouping(table, left_out),
                        frozenset(p for p, r in self.hints.items() if r == (round, state)),
                        frozenset(self.conduct.not_vouching(table, now)), self.swarm.table_fresh,
                        self.reachability.reachable is True)
            decision = gathering.decide(now, look)
            if decision.action == "behind":
                raise Behind()
            hinted_to = self._hint_leader(look.grouping, round, hinted_to, decision.ready)
            if decision.action == "lead" and (self.plane.hostile.silent_leader or benched):
                pass  # left out by the ledger, or test-only: a leader that announces ready and never starts
            elif decision.action == "lead":
                group = await self.lead(round, decision.ready, decision.owners)
                if group is not None:
                    if decision.training:
                        log.info("round %d starts without %d straggler(s)", round + 1, len(decision.training))
                        self.metrics.stragglers_excluded.inc(len(decision.training))
                    return group
            elif decision.action == "leave_out":
                leader = decision.leader
                log.warning("leader %s of round %d never started it; leaving it out", leader[-8:], round)
                # Out long enough for the others to gather and average without it.
                self.conduct.suspect(leader, 3 * cfg.heartbeat_interval + self.gather_timeout
                                     + self.plane.deadlines.ceiling)
                self.conduct.offence(leader, "silent_leader")
            if time.monotonic() - reported > WAIT_REPORT_SECONDS:
                reported = time.monotonic()
                log.info("round %d: still gathering after %.0fs: %d ready, %d training, %s, table %s",
                         round + 1, reported - started, len(decision.ready), len(decision.training),
                         decision.reason, "fresh" if self.swarm.table_fresh else "stale")
            if self.waiting.group.done():  # a leader's begin came in while we looked
                return self.waiting.group.result()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._wake.wait()
            if self.waiting.group.done():
                return self.waiting.group.result()
            woken = self._wake.is_set()

    def _grouping(self, table: dict, left_out: set[str]) -> dict:
        """The peers we would group with (``Conduct.grouping``), less those the ledger leaves out."""
        return {p: r for p, r in self.conduct.grouping(table).items() if p not in left_out}

    def _hint_leader(self, peers: dict, round: int, hinted_to: str | None, ready=()) -> str | None:
        """Hint the peer expected to lead ``round`` (unless that is us or it was hinted already); returns it."""
        expected = expected_leader(self.swarm.peer_id, round, peers, ready, self.reachability.reachable is True)
        if expected != self.swarm.peer_id and expected != hinted_to:
            # Best effort, in the background: the DHT poll still gets the news to the leader.
            state = self.waiting.state if self.waiting is not None else ""
            self._background(self._call(expected, "ready", {"r": round, "h": state}))
            return expected
        return hinted_to

    # ---- lead: propose the group --------------------------------------------------------

    async def lead(self, round: int, members: list[str], owners: list[str] | None = None) -> Group | None:
        """Propose the group to every member; all must accept or the attempt is cancelled.
        ``owners``: the members that own a part (``gathering.owners``; None: all)."""
        waiting = self.waiting
        if waiting.group.done():
            return waiting.group.result()
        others = [p for p in members if p != self.swarm.peer_id]
        # As many lanes as the farthest member's round-trip time asks for (p2p/lanes.py).
        lanes = lanes_for_rtt(self._farthest(members))
        proposed = self.checks.for_proposal() if self.checks is not None else []
        records = self.checks.accept(proposed) if proposed else []
        group = self._new_group(os.urandom(16), round, members, waiting, lanes, owners, records)
        self._install(group)
        waiting.group.set_result(group)
        for p in members:  # a hint counts once: after this attempt a member is ready again only when it says so
            self.hints.pop(p, None)
        header = {"g": group.id, "r": round, "members": members, "numel": waiting.flat.numel(),
                  "codec": self.plane.codec.name, "h": waiting.state, "lanes": lanes,
                  "sd": self.standing(round).digest(members),
                  **({"checks": proposed} if proposed else {}),
                  **({"owners": owners} if owners else {})}
        results = await asyncio.gather(*(self._call(p, "begin", header) for p in others), return_exceptions=True)
        refused = [p for p, res in zip(others, results) if isinstance(res, BaseException) or not res[0].get("ok")]
        if not refused:
            return group
        for p, res in zip(others, results):
            if p in refused:
                silent = isinstance(res, BaseException)
                self.conduct.suspect(p, None if silent else POLL_SECONDS * 4)
                log.info("round %d: %s %s the group", round + 1, p[-8:],
                         "did not answer" if silent else f"refused ({str(res[0].get('reason'))[:40]})")
        await self.votes.abort(group, "member_refused", members.index(refused[0]))
        self.plane.leave(group)
        self.metrics.rounds_aborted.labels(reason="member_refused").inc()
        self._set(Wait(round, waiting.flat, waiting.weight, asyncio.get_running_loop().create_future(),
                       waiting.state, waiting.donated))
        return None

    def _new_group(self, gid: bytes, round: int, members: list[str], waiting: Wait, lanes: int,
                   owners: list[str] | None, checks: list | None = None) -> Group:
        group = self.plane.new_group(gid, round, members, waiting.flat, waiting.weight,
                                     residual_added=waiting.donated, lanes=lanes, owners=owners,
                                     factors=self.standing(round).factors(members), checks=checks)
        group.rtt = self._farthest(members)  # deadlines grow with it (p2p/deadline.py)
        return group

    def _farthest(self, members) -> float | None:
        """The longest round-trip time we measured to another of ``members`` (None: none measured)."""
        return max((r for p in members if p != self.swarm.peer_id and (r := self.plane.dial.rtt(p)) is not None),
                   default=None)

    def _install(self, group: Group) -> None:
        self.plane.install(group)
        self._wake.set()

    # ---- requests in -------------------------------------------------------------------

    async def on_begin(self, sender: str, header: dict, reader, writer) -> None:
        """A leader's ``begin``: join its group, or say why not."""
        begin = Proposal.parse(sender, header, self.swarm.peer_id)
        if self.conduct.quarantine.quarantined(sender, time.monotonic()):
            await reply(writer, {"ok": False, "reason": "quarantined"})
            self.conduct.tell_refused(sender, begin.round, begin.members)
            return
        if sender in self.conduct.shunned(self.swarm.peers, time.monotonic()):
            await reply(writer, {"ok": False, "reason": "shunned"})
            return
        waiting = await self._waiting_for(begin.round)
        if waiting is None:
            await reply(writer, {"ok": False, "reason": "not_waiting"})
            return
        refused = begin.refusal(numel=waiting.flat.numel(), state=waiting.state, codec=self.plane.codec.name,
                                live=live_peers(self.swarm.peers, self.swarm.peer_id), min_peers=self.min_peers,
                                standing=self.standing(begin.round))
        if refused:
            if refused == "no_quorum":
                log.info("round %d: refusing a group of %d from %s: %s", begin.round + 1, len(begin.members),
                         sender[-8:], refused)
            await reply(writer, {"ok": False, "reason": refused})
            return
        try:  # the leader's check records, each verified (p2p/checks.py)
            records = self.checks.accept(header.get("checks", [])) if self.checks is not None else []
        except ValueError:
            await reply(writer, {"ok": False, "reason": "bad_checks"})
            return
        group = self._new_group(begin.gid, begin.round, begin.members, waiting, begin.lanes, begin.owners, records)
        self._install(group)
        waiting.group.set_result(group)
        await reply(writer, {"ok": True})

    async def _waiting_for(self, round: int) -> Wait | None:
        """Our wait for a group of ``round``, if we are in one or about to be: a member whose last
        attempt just ended is on its way back (a moment), and a leader that was told at once
        would otherwise call its group off for that moment."""
        deadline = time.monotonic() + min(1.0, self.request_timeout / 4)
        while True:
            waiting = self.waiting
            if waiting is not None and waiting.round == round and not waiting.group.done():
                return waiting
            if waiting is not None and (waiting.round != round or waiting.group.done()):
                return None  # at another round, or in another group already
            self._waiting_set.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._waiting_set.wait()
            except TimeoutError:
                return None

    async def on_ready(self, sender: str, header: dict, reader, writer) -> None:
        """A peer's hint that it is ready for a round (it expects us to lead)."""
        round, state = hfield(header, "r", int), header.get("h", "")
        if not isinstance(state, str) or len(state) > 128:
            raise WireError("bad_field", "h")
        # One hint per peer (its latest), at most 4096 peers; only for the round we wait in.
        if round >= 0 and (self.waiting is None or round >= self.waiting.round):
            self.hints[sender] = (round, state)
            self._wake.set()
        await reply(writer, {"ok": True})
