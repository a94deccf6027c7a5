"""The swarm's implementation of the averaging interface: one outer round, all or nothing.

A round on this peer goes: announce ``ready`` for round r in the DHT (and
tell the peer it expects to lead directly, so the leader need not wait for
its next DHT poll to see it); wait until every live peer of round r is ready
(or ``gather_timeout``); once a strict majority of the peers live at round r
is ready (``quorum.py``: two groups can never both commit a round), the ready
peer with the smallest id leads and sends
``begin`` with the sorted member list to the others; every member must
accept, else the attempt is cancelled and retried without the silent ones.
Members then run the butterfly all-reduce of ``group.py`` over libp2p streams
(``exchange.py``) and vote on the digest of the result. Any failure (a member
dead, slow, refusing, or sending garbage) fails the attempt on every member
that hears of it: they apply nothing and retry with the survivors. A peer
that finds the swarm already past its round returns ``behind``, and the node
re-syncs its state from peers.

Every request is checked against the group's member list; libp2p
authenticates the remote peer id, so a stranger cannot contribute or vote.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import torch

from p2p.codecs import ErrorFeedback, get_codec
from p2p.commits import CommitLog
from p2p.compression import CommittedAverage, base_vector, flatten
from p2p.deadline import DeadlinePolicy
from p2p.exchange import all_or_fail, off_loop
from p2p.faults import NO_FAULTS, Faults
from p2p.group import MAX_LANES, Group, RoundFailed, lanes_for_rtt
from p2p.hostile import HONEST, Behaviour
from p2p.limits import BoundedDict
from p2p.quarantine import UNREACHABLE, Quarantine, Refusals
from p2p.quorum import accept_group, can_start, follow, live_peers, quorum, shunned
from p2p.reachability import Reachability
from p2p.shard import DATA_REQUESTS, Dialer, ShardPlane, combined_digest, guarded, shard_names
from p2p.signing import CommitSigning
from p2p.swarm import Swarm
from p2p.wire import SMALL_HEADER_BYTES, WireError, field as hfield, reply

log = logging.getLogger(__name__)

# The control plane's requests; a shard's all-reduce and audit are its own (p2p/shard.py).
CONTROL_REQUESTS = ("begin", "vote", "ready", "sign", "refuse", "dialback")

POLL_SECONDS = 0.25
WAIT_REPORT_SECONDS = 15.0  # how often a long gather says what it is waiting for
# A member our vote did not reach may still have voted: votes cross, so its own may arrive
# this long after our send to it failed (see RoundProtocol._to_all).
VOTE_GRACE_SECONDS = 2.0
VOTE_GRACE_TRIPS = 8  # or this many of the group's round trips, if longer


@dataclass(slots=True)
class RoundOutcome:
    """How the last ``average`` call ended."""

    status: str  # committed | aborted | behind
    reason: str = ""
    group_id: str = ""
    members: list[str] = field(default_factory=list)
    gather_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    blamed: list[str] = field(default_factory=list)  # members this peer held to account for it
    # Seconds of the attempt's steps after the gather on this peer (``Group.phases``).
    phases: dict[str, float] = field(default_factory=dict)
    owners: list[str] = field(default_factory=list)  # the members that owned a part (empty: all)


@dataclass(eq=False)
class _Waiting:
    round: int
    flat: torch.Tensor
    weight: float
    group: asyncio.Future
    state: str = ""  # params_hash of the state the pseudo-gradient was taken from ("": not checked)
    donated: bool = False  # ``flat`` is the caller's vector, the residual added once (``average``)


class RoundProtocol:
    """``average(tensors, weight, round)`` over the swarm; see the module docstring."""

    def __init__(self, swarm: Swarm, metrics, commits: CommitLog | None = None, *, weight_cap: float = 0.0,
                 faults: Faults = NO_FAULTS, hostile: Behaviour = HONEST) -> None:
        """``commits``: this node's chain of commit certificates, which ``certify`` extends (a
        benchmark that never certifies may leave it out). ``weight_cap``: the most tokens one
        member's round can weigh (0: relative to the others). ``faults`` and ``hostile``: test
        hooks (p2p/faults.py, p2p/hostile.py; the node's own, from ``node.config.load_injection``),
        none and honest by default; the training loop reads them here too."""
        self.swarm = swarm
        self.faults = faults
        self.metrics = metrics
        self.commits = commits if commits is not None else CommitLog(swarm.scope, genesis="")
        # The members' signatures on the rounds this node commits (``certify``).
        self.signing = CommitSigning(swarm, self.commits, lambda peer, header: self._call(peer, "sign", header))
        cfg = swarm.config
        self.quarantine = Quarantine(cfg.quarantine_seconds)
        self.min_peers = cfg.min_peers
        self.gather_timeout = cfg.gather_timeout
        self.deadlines = DeadlinePolicy(ceiling=cfg.round_timeout, floor=min(5.0, cfg.round_timeout))
        self.codec = get_codec(cfg.codec)
        self.request_timeout = cfg.request_timeout
        self._names = shard_names(swarm.scope, CONTROL_REQUESTS + DATA_REQUESTS, None)
        self.dial = Dialer(swarm.p2p, self._names, cfg.request_timeout, metrics, swarm.connect_to)
        # This host's shard of every round (its whole pseudo-gradient on a single-rank host).
        self.plane = ShardPlane(me=swarm.peer_id, codec=self.codec,
                                use_feedback=cfg.error_feedback and self.codec.name != "fp32",
                                aggregator=cfg.aggregator, weight_cap=weight_cap, hostile=hostile, faults=faults,
                                dial=self.dial,
                                metrics=metrics, reject=swarm.reject, offence=self.offence, deadlines=self.deadlines,
                                request_timeout=cfg.request_timeout)
        # The other ranks' shards of a multi-rank host (node/ranks.py), reduced in the same groups.
        self.shards = None
        self._waiting: _Waiting | None = None
        self._donated = None  # weakref to the last donated vector, its residual added (see average)
        self._waiting_set = asyncio.Event()  # set whenever a new wait for a group starts
        self._suspects: BoundedDict = BoundedDict(4096)
        self._floods: BoundedDict = BoundedDict(4096)  # peer -> when its last flood strike was given
        # Peers that told us directly they are ready for a round (peer -> round).
        self._ready_hints: BoundedDict = BoundedDict(4096)
        # Wakes a gather before its next poll: a hint came in, or a group was installed.
        self._wake = asyncio.Event()
        self._background_tasks: set[asyncio.Task] = set()
        # Leaders that peers told us they refuse (they quarantined it); see ``quorum.shunned``.
        self.refusals = Refusals(cfg.quarantine_seconds)
        # Peers that announced a state which showed us no certificate chain: peer -> (that
        # params_hash, until when). See ``not_vouching``.
        self._unverified: BoundedDict = BoundedDict(4096)
        self.last = RoundOutcome("none")
        self._flood_task: asyncio.Task | None = None
        # Whether peers can dial this node (p2p/reachability.py); asked by the node, answered here.
        self.reachability = Reachability(swarm, lambda peer, header, timeout: self._call(peer, "dialback", header,
                                                                                         timeout),
                                         cfg.request_timeout)

    async def start(self) -> None:
        kernels = getattr(self.codec, "kernels", None)
        if kernels is not None:  # build or load a 4-bit codec's C kernels now, not inside the first round
            await asyncio.to_thread(kernels)
        p2p = self.swarm.p2p
        # A begin lists every member; every other request is a handful of fields.
        await p2p.add_binary_stream_handler(self._names["begin"], self._guard(self._on_begin, max_header=None))
        for name in CONTROL_REQUESTS[1:]:
            await p2p.add_binary_stream_handler(self._names[name], self._guard(getattr(self, f"_on_{name}")))
        await self.plane.start(p2p, self._guard)
        if self.hostile.flood:
            self._flood_task = asyncio.ensure_future(self._flood())

    async def _flood(self) -> None:
        """Test-only (p2p/hostile.py): open streams to every peer and never write a byte on them."""
        held = []
        while True:
            for peer in list(await self.swarm.refresh_peers(max_age=1.0)):
                for _ in range(16):
                    with contextlib.suppress(Exception):
                        held.append(await self._open(peer, "part"))
            del held[:-4096]
            await asyncio.sleep(1.0)

    # ---- the averaging interface ---------------------------------------------------

    # The shard's settings, read by every new group: test-only lies (p2p/hostile.py; honest
    # unless set), the cap on a member's weight, how part owners combine contributions.
    hostile = property(lambda self: self.plane.hostile, lambda self, v: setattr(self.plane, "hostile", v))
    weight_cap = property(lambda self: self.plane.weight_cap, lambda self, v: setattr(self.plane, "weight_cap", v))
    aggregator = property(lambda self: self.plane.aggregator)
    exchange = property(lambda self: self.plane.exchange)

    @property
    def feedback(self) -> ErrorFeedback | None:
        return self.plane.feedback

    def delta_target(self) -> torch.Tensor | None:
        """Where the next pseudo-gradient may be computed (``pseudo_gradient(into=)``) and then
        donated: error feedback's vector, once the last round that held it committed; None
        (a vector of the caller's own) otherwise, or before the first round."""
        return self.plane.delta_target()

    def ensure_feedback(self, numel: int) -> ErrorFeedback | None:
        """The error-feedback residual of this host's shard (None if not used)."""
        return self.plane.ensure_feedback(numel)

    async def average(self, tensors: list[torch.Tensor], weight: float, round: int, *,
                      state: str = "", donate: bool = False) -> CommittedAverage | None:
        """Average with the members of ``round`` that hold the same state (``state``, its
        params_hash: two lineages of one round number never mix in one group).

        ``donate``: the tensors are views of one vector (``compression.base_vector``) that the
        round takes as its buffer instead of a copy of it: with error feedback the residual is
        folded into it (once: an attempt again with the same tensors sends what the first one
        did) and it becomes the residual's vector, which the round overwrites with the next
        residual (``ShardPlane.fold``); give a new vector to the next round.

        The average comes back shaped like ``tensors`` and decoded as it is read
        (``CommittedAverage``: over the donated vector without error feedback, into tensors of
        their own with it, into a fresh vector if not donated); None if the attempt did not
        commit (``last`` says why)."""
        numel = sum(t.numel() for t in tensors)
        feedback = self.ensure_feedback(numel)
        residual = feedback.residual if feedback is not None else None
        flat = base_vector(tensors) if donate else None
        donated = flat is not None
        if not donated:
            # A copy of ~4 bytes per parameter, the residual added on the way: not on the event loop.
            flat = await off_loop(flatten, tensors, self.plane.buffer("flat", numel), residual)
            fresh = True
        else:
            fresh = self._donated is None or self._donated() is not flat
            if fresh:
                # Noted first: a cancelled wait does not stop the thread from adding it.
                self._donated = weakref.ref(flat)
                if residual is not None:
                    # The residual's vector is ``flat`` from here on; the old one is given back.
                    try:
                        await off_loop(self.plane.fold, flat)
                    except ValueError:  # a vector a round holds already, given again: nothing was added
                        self._donated = None
                        raise
        if self.hostile.any and fresh:
            await off_loop(_hostile_input, flat, self.hostile)
        # Not ready before we know whether peers can dial us (a moment, once: p2p/reachability.py).
        await self.reachability.settled()
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        self._waiting = _Waiting(round, flat, float(weight), loop.create_future(), state, donated)
        self._waiting_set.set()
        self.swarm.announce(state="ready", round=round)
        try:
            group = await self._gather(round, started)
        except _Behind:
            self.last = RoundOutcome("behind", "swarm_ahead", gather_seconds=time.monotonic() - started)
            return None
        finally:
            self._waiting = None
        gathered = time.monotonic()
        self.metrics.gather_wait_seconds.observe(gathered - started)
        self.metrics.round_members.set(len(group.members))
        self.swarm.announce(state="averaging")
        self.faults.checkpoint("grouped", round + 1, len(group.members))
        try:
            await self._allreduce(group)
            # Committed. Known to signing before the group is left: a faster member's signature
            # may arrive while we still write the residual or end the round on our ranks, and
            # it must find the group then (after leaving, nothing else names it).
            self.signing.committed(group.id, group.members, round + 1,
                                   [group.members[i] for i in group.voters()])
        except (RoundFailed, asyncio.CancelledError) as e:
            reason = e.reason if isinstance(e, RoundFailed) else "stopping"
            await asyncio.shield(self._broadcast_abort(group, reason))
            if self.shards is not None:
                await asyncio.shield(self.shards.end(group, committed=False))
            self.metrics.averaging_failures.labels(reason=reason).inc()
            self.last = RoundOutcome("aborted", reason, group.id.hex()[:8], group.members,
                                     gathered - started, time.monotonic() - gathered, self._judge(group),
                                     group.phases(gathered))
            log.warning("round %d attempt %s with %d members aborted: %s", round + 1, group.id.hex()[:8],
                        len(group.members), e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return None
        finally:
            self._leave(group)
        blamed = self._judge(group)
        seconds = time.monotonic() - gathered
        if group.in_place:  # what the codec dropped of what we sent, for the next round
            await asyncio.shield(off_loop(group.write_residual))
        self.plane.committed(group)
        if self.shards is not None:
            await self.shards.end(group, committed=True)
        self.deadlines.observe(seconds)
        self.metrics.allreduce_seconds.observe(seconds)
        self.last = RoundOutcome("committed", "", group.id.hex()[:8], group.members, gathered - started, seconds,
                                 blamed, group.phases(gathered), list(group.owners or []))
        self.faults.checkpoint("commit", round + 1, len(group.members))
        # Donated: over our contribution, which nobody needs now (the vector holds the average
        # from here on: given again, it is a new round's input). Otherwise ``flat`` is the
        # plane's buffer, which the next round fills again: the result is the caller's own.
        out = None if donated else torch.empty(numel, dtype=torch.float32)
        self._donated = None
        return group.committed_average(tensors, out)

    # ---- gather: who is in this round ----------------------------------------------

    def _suspect(self, peer_id: str, seconds: float) -> None:
        self._suspects[peer_id] = time.monotonic() + seconds

    def _live(self, peers) -> dict:
        """The peers this node would group with: neither suspected, quarantined, nor shunned
        (enough peers refuse its groups that it cannot lead one that commits: waiting for it
        to lead would only stall the round)."""
        now = time.monotonic()
        self._suspects.retain(lambda p, t: t > now)
        out = self.quarantine.active(now) | self._shunned(peers, now)
        return {p: r for p, r in peers.items() if p not in self._suspects and p not in out}

    def _dialable(self, peer: str, table) -> bool:
        """Whether ``peer`` is known to accept dials: its heartbeat says so (for us: our own check)."""
        if peer == self.swarm.peer_id:
            return self.reachability.reachable is True
        record = table.get(peer)
        return record is not None and record.reachable is True

    def _owners(self, members, table) -> list[str] | None:
        """The members of a group that own a part (``Group.owners``): those known to accept dials,
        if there are at least two of them and some member is not one; None (all own) otherwise.
        The first of them leads. Members that may sit behind NAT then never have to meet:
        each only dials the owners, which reach it over the connections it opened."""
        owners = sorted(m for m in set(members) if self._dialable(m, table))
        return owners if 2 <= len(owners) < len(set(members)) else None

    def _leader_of(self, members, table) -> str:
        owners = self._owners(members, table)
        return owners[0] if owners else min(members)

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

    def _shunned(self, peers, now: float) -> set[str]:
        live = live_peers(peers, self.swarm.peer_id)
        return {leader for leader in self.refusals.leaders() if leader in live
                and shunned(self.refusals.refusers(leader, now), live, self.min_peers)}

    def offence(self, peer: str, reason: str) -> None:
        """Record what a peer did (p2p/quarantine.py); count and log a new quarantine."""
        if peer != self.swarm.peer_id and self.quarantine.offence(peer, reason, time.monotonic()):
            # Every peer hears at once that we refuse its groups now, not only the members of the
            # next group it leads (they accept that begin before our word reaches them), and not
            # only the live ones: one still joining is live in a moment, and would not hear it.
            self._tell_refused(peer, self.swarm.round, self.swarm.peers)
            self.metrics.quarantined.labels(reason=reason).inc()
            self.metrics.quarantined_peers.set(len(self.quarantine.active(time.monotonic())))
            log.warning("quarantined peer %s for %.0fs: %s", peer[-8:], self.quarantine.seconds, reason)

    def _flooded_by(self, peer: str) -> None:
        """``peer`` has as many streams open to us as it may: a peer we cannot even hear out is no
        member to group with. A strike, at most one a second (a flood is many refusals at once;
        an honest peer that a slow moment piled up gets one), and out of our groups for a while."""
        now = time.monotonic()
        last = self._floods.get(peer)
        if last is None or now - last >= 1.0:
            self._floods[peer] = now
            self._suspect(peer, 3 * self.swarm.config.heartbeat_interval)
            self.offence(peer, "stream_flood")

    def _judge(self, group: Group) -> list[str]:
        """After an attempt: the members whose input (or output, as owners) this peer refused,
        and whoever started the aborts it got (a strike; quarantine if it started those of our
        attempt before too: ``Quarantine.attempt_over``). Returns them."""
        blamed = dict(group.blame)
        starter = group.abort_starter()
        reason = group.aborts.get(starter, "")
        culprit = group.abort_culprit(starter)
        offence = self.quarantine.attempt_over(starter, culprit is not None, time.monotonic(), reason)
        if reason == UNREACHABLE and culprit is not None:  # p2p/quarantine.py: out of the retry, both
            for peer in (starter, culprit):
                if peer != self.swarm.peer_id:
                    self._suspect(peer, 3 * self.swarm.config.heartbeat_interval)
        elif group.failure is not None and group.failure.reason == UNREACHABLE and group.failed_by is not None:
            self._suspect(group.failed_by, 3 * self.swarm.config.heartbeat_interval)  # we could not dial it
        if offence is not None:
            blamed.setdefault(starter, offence)
        for peer, what in blamed.items():
            self.offence(peer, what)
        return sorted(blamed)

    async def _gather(self, round: int, started: float) -> Group:
        leader_wait_limit = self.gather_timeout + 2 * self.request_timeout
        waited_for_leader: dict[str, float] = {}
        all_in_since: dict[str, float] = {}  # leader -> since when we see a quorum ready and nobody training
        all_in_wait_limit = 2 * self.request_timeout + 2 * self.swarm.config.heartbeat_interval
        reported = started
        self._ready_hints.retain(lambda p, r: r[0] >= round)
        state = self._waiting.state
        # Hint at once from the last table read; the fresh read below corrects the guess if needed.
        hinted_to = self._hint_leader(self._live(self.swarm.peers), round, None)
        woken = False
        while True:
            # Woken by a peer's hint: the table read a moment ago is fresh enough.
            table = await self.swarm.refresh_peers(max_age=POLL_SECONDS if woken else 0.0)
            # Suspected and quarantined peers stay in the quorum's count while they heartbeat.
            live = live_peers(table, self.swarm.peer_id)
            peers = self._live(table)
            # The swarm moved on: a majority of the others hold a newer round (or, once we have
            # waited a whole gather without a quorum, enough of them to be one with us).
            stuck = time.monotonic() - started > self.gather_timeout
            why, _ = follow(table, self.swarm.peer_id, (round, ""), excluded=self.not_vouching(table, time.monotonic()),
                            patient=stuck)
            if why == "behind":
                raise _Behind()
            hinted = {p for p, r in self._ready_hints.items() if r == (round, state) and p in peers}
            ready = sorted({p for p, r in peers.items() if r.round == round and r.state == "ready"
                            and (not state or r.params_hash == state)} | hinted | {self.swarm.peer_id})
            training = [p for p, r in peers.items() if r.round == round and r.state == "training" and p not in hinted]
            hinted_to = self._hint_leader(peers, round, hinted_to, ready)
            leader = self._leader_of(ready, table)
            timed_out = time.monotonic() - started > self.gather_timeout
            can_lead = self.swarm.table_fresh or timed_out
            enough, short = can_start(ready, live, self.min_peers)
            if self.hostile.silent_leader and leader == self.swarm.peer_id:
                pass  # test-only: a leader that announces ready and never starts the round
            elif leader == self.swarm.peer_id and can_lead and enough and (not training or timed_out):
                group = await self._lead(round, ready, self._owners(ready, table))
                if group is not None:
                    if training:
                        log.info("round %d starts without %d straggler(s)", round + 1, len(training))
                        self.metrics.stragglers_excluded.inc(len(training))
                    return group
            elif leader != self.swarm.peer_id and not enough:
                waited_for_leader.pop(leader, None)  # no quorum in our view either: nobody to blame
                all_in_since.pop(leader, None)
            elif leader != self.swarm.peer_id:
                now = time.monotonic()
                first_seen = waited_for_leader.setdefault(leader, now)
                # Once nobody we see is still training, an honest leader starts at its next look
                # (one begin round, a heartbeat or two for its table to show what ours does).
                if training:
                    all_in_since.pop(leader, None)
                    settled = 0.0
                else:
                    settled = now - all_in_since.setdefault(leader, now)
                if now - first_seen > leader_wait_limit or settled > all_in_wait_limit:
                    log.warning("leader %s of round %d never started it; leaving it out", leader[-8:], round)
                    # Out long enough for the others to gather and average without it.
                    self._suspect(leader, 3 * self.swarm.config.heartbeat_interval + self.gather_timeout
                                  + self.deadlines.ceiling)
                    self.offence(leader, "silent_leader")
                    waited_for_leader.pop(leader)
                    all_in_since.pop(leader, None)
            if time.monotonic() - reported > WAIT_REPORT_SECONDS:
                reported = time.monotonic()
                log.info("round %d: still gathering after %.0fs: %d ready, %d training, %s, table %s",
                         round + 1, reported - started, len(ready), len(training),
                         short or f"{quorum(len(live), self.min_peers)} of {len(live)} live needed",
                         "fresh" if self.swarm.table_fresh else "stale")
            if self._waiting.group.done():  # a leader's begin came in while we looked
                return self._waiting.group.result()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._wake.wait()
            if self._waiting.group.done():
                return self._waiting.group.result()
            woken = self._wake.is_set()

    def _hint_leader(self, peers: dict, round: int, hinted_to: str | None, ready=()) -> str | None:
        """Hint the peer expected to lead ``round`` (unless that is us or it was hinted already); returns it."""
        # Whoever will lead: of the peers at (or about to reach) this round, the first owner.
        expected = self._leader_of([self.swarm.peer_id, *ready, *(p for p, r in peers.items()
                                                                  if r.round >= round - 1 and r.state != "joining")],
                                   peers)
        if expected != self.swarm.peer_id and expected != hinted_to:
            self._hint(expected, round)
            return expected
        return hinted_to

    def _tell_refused(self, leader: str, round: int, peers) -> None:
        """We refuse ``leader``'s groups (quarantined): tell ``peers`` (each once a round), so that
        they stop joining them once enough of us do (``shunned``)."""
        async def tell(peer: str) -> None:  # a few tries: a busy moment must not cost the round its word
            for attempt in range(3):
                try:
                    await self._call(peer, "refuse", {"leader": leader})
                    return
                except (RoundFailed, WireError, OSError, asyncio.IncompleteReadError) as e:
                    log.debug("telling %s that we refuse %s failed: %r", peer[-8:], leader[-8:], e)
                    await asyncio.sleep(0.5 * (attempt + 1))

        for peer in self.refusals.to_tell(leader, round, [p for p in peers if p != self.swarm.peer_id]):
            self._background(tell(peer))

    async def _on_refuse(self, sender: str, header: dict, reader, writer) -> None:
        leader = hfield(header, "leader", str)
        if len(leader) > 128 or leader == sender:
            raise WireError("bad_field", "leader")
        self.refusals.told_us(sender, leader, time.monotonic())
        await reply(writer, {"ok": True})

    def _background(self, call) -> None:
        """Run a best-effort request in the background (kept until done, errors logged at debug)."""
        async def run():
            try:
                await call
            except Exception as e:
                log.debug("background request failed: %r", e)

        task = asyncio.ensure_future(run())
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)

    def _hint(self, peer: str, round: int) -> None:
        """Tell ``peer`` (the expected leader) that we are ready for ``round``; best effort, in the
        background (the DHT poll still gets the news to the leader)."""
        state = self._waiting.state if self._waiting is not None else ""
        self._background(self._call(peer, "ready", {"r": round, "h": state}))

    async def _lead(self, round: int, members: list[str], owners: list[str] | None = None) -> Group | None:
        """Propose the group to every member; all must accept or the attempt is cancelled.
        ``owners``: the members that own a part (``_owners``; None: all)."""
        waiting = self._waiting
        if waiting.group.done():
            return waiting.group.result()
        others = [p for p in members if p != self.swarm.peer_id]
        # As many lanes as the farthest member's round-trip time asks for (group.lanes_for_rtt).
        lanes = lanes_for_rtt(self._farthest(members))
        group = self._new_group(os.urandom(16), round, members, waiting, lanes, owners)
        self._install(group)
        waiting.group.set_result(group)
        for p in members:  # a hint counts once: after this attempt a member is ready again only when it says so
            self._ready_hints.pop(p, None)
        header = {"g": group.id, "r": round, "members": members, "numel": waiting.flat.numel(),
                  "codec": self.codec.name, "h": waiting.state, "lanes": lanes,
                  **({"owners": owners} if owners else {})}
        results = await asyncio.gather(*(self._call(p, "begin", header) for p in others), return_exceptions=True)
        refused = [p for p, res in zip(others, results) if isinstance(res, BaseException) or not res[0].get("ok")]
        if not refused:
            return group
        for p, res in zip(others, results):
            if p in refused:
                silent = isinstance(res, BaseException)
                self._suspect(p, 3 * self.swarm.config.heartbeat_interval if silent else POLL_SECONDS * 4)
                log.info("round %d: %s %s the group", round + 1, p[-8:],
                         "did not answer" if silent else f"refused ({str(res[0].get('reason'))[:40]})")
        await self._broadcast_abort(group, "member_refused", members.index(refused[0]))
        self._leave(group)
        self.metrics.rounds_aborted.labels(reason="member_refused").inc()
        self._waiting = _Waiting(round, waiting.flat, waiting.weight, asyncio.get_running_loop().create_future(),
                                 waiting.state, waiting.donated)
        self._waiting_set.set()
        return None

    def _new_group(self, gid: bytes, round: int, members: list[str], waiting: _Waiting, lanes: int,
                   owners: list[str] | None) -> Group:
        group = self.plane.new_group(gid, round, members, waiting.flat, waiting.weight,
                                     residual_added=waiting.donated, lanes=lanes, owners=owners)
        group.rtt = self._farthest(members)  # deadlines grow with it (p2p/deadline.py)
        return group

    def _farthest(self, members) -> float | None:
        """The longest round-trip time we measured to another of ``members`` (None: none measured)."""
        return max((r for p in members if p != self.swarm.peer_id and (r := self.dial.rtt(p)) is not None),
                   default=None)

    def _leave(self, group: Group) -> None:
        """The attempt is over: requests naming it are answered at once from now on."""
        self.plane.leave(group)

    def _install(self, group: Group) -> None:
        self.plane.install(group)
        self._wake.set()

    # ---- all-reduce and vote ----------------------------------------------------------

    async def _allreduce(self, group: Group) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadlines.deadline(group.rtt)
        if self.hostile.abort:
            raise RoundFailed("hostile")  # test-only: a member that aborts every group it joins
        others = [p for p in group.members if p != group.me]
        # Every shard of the host in the same group at once (node/ranks.py: the other ranks');
        # the vote is on all of them, so the round commits for every shard or for none.
        own = asyncio.ensure_future(self.plane.reduce(group, deadline))
        if self.shards is None:
            await all_or_fail([own], group)
            vote = own.result()
        else:
            theirs = asyncio.ensure_future(self.shards.reduce(group, deadline))
            await all_or_fail([own, theirs], group)
            vote = combined_digest([own.result(), *theirs.result()])
        group.add_vote(group.index, vote)
        header = {"g": group.id, "digest": vote}
        # To the owners at once (every member, if all own a part). Members that own none hear an
        # owner's vote only once the owner holds every vote and all are equal: theirs then says
        # the whole group agreed, and they never have to meet each other (``Group.voters``).
        owners = [group.members[i] for i in group.owner_indices() if i != group.index]
        agreed = asyncio.ensure_future(group.agreed(deadline))
        await self._to_all(group, owners, header, agreed)
        group.mark("voted")
        if not agreed.result():
            raise RoundFailed("digest_mismatch")
        if group.owns[group.index]:
            for peer in others:
                if peer not in owners:
                    self._background(self._vote_to(group, peer, header))

    async def _to_all(self, group: Group, others: list[str], header: dict, until) -> None:
        """Send our vote to every other member and wait for ``until`` (all or fail).

        A member whose vote we hold cannot fail the round here by not acknowledging ours: it
        voted, and may have committed and died before its reply left (a member killed right
        after its commit). Aborting then would leave the round committed by too few members to
        certify it, and the swarm split between two rounds. Only a member we never heard from
        (within ``VOTE_GRACE_SECONDS`` of the failure: votes cross) fails us."""
        async def send(peer: str) -> None:
            try:
                await self._call(peer, "vote", header)
            except (RoundFailed, WireError, ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError):
                grace = max(VOTE_GRACE_SECONDS, VOTE_GRACE_TRIPS * (group.rtt or 0))
                grace = min(group.deadline or float("inf"), asyncio.get_running_loop().time() + grace)
                if not await group.voted(group.members.index(peer), grace):
                    raise

        sends = [asyncio.ensure_future(send(p)) for p in others]
        await all_or_fail([*sends, asyncio.ensure_future(until)], group)

    async def _vote_to(self, group: Group, peer: str, header: dict) -> None:
        """Our vote to a member that owns no part, after the group agreed: it waits for every
        owner's (a few tries, until the group's deadline: it commits only with all of them)."""
        loop = asyncio.get_running_loop()
        for attempt in range(3):
            try:
                await self._call(peer, "vote", header)
                return
            except (RoundFailed, WireError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
                if attempt == 2 or loop.time() + 0.5 * (attempt + 1) > group.deadline:
                    raise
                log.debug("vote to %s failed, again: %r", peer[-8:], e)
                await asyncio.sleep(0.5 * (attempt + 1))

    async def _broadcast_abort(self, group: Group, reason: str, culprit: int | None = None) -> None:
        """Every other member hears that the attempt is off, why, and whom we failed on (if anyone:
        ``Group.culprit``): an abort that names nobody else is ours to answer for (p2p/quarantine.py)."""
        others = [group.members[i] for i in group.voters() if i != group.index]
        if culprit is None:
            culprit = group.culprit(reason)
        header = {"g": group.id, "abort": reason[:40], **({"c": culprit} if culprit is not None else {})}
        await asyncio.gather(*(self._call(p, "vote", header, timeout=2.0) for p in others), return_exceptions=True)

    # ---- requests out ------------------------------------------------------------------

    async def _open(self, peer: str, name: str):
        return await self.dial.open(peer, name)

    async def _send(self, peer: str, name: str, header: dict, payload: bytes) -> None:
        await self.dial.send(peer, name, header, payload)

    async def _call(self, peer: str, name: str, header: dict, timeout: float | None = None, max_payload: int = 0):
        return await self.dial.call(peer, name, header, timeout, max_payload)

    # ---- requests in -------------------------------------------------------------------

    def _guard(self, handler, max_header: int | None = SMALL_HEADER_BYTES):
        """Only admitted peers, bounded streams per peer, one deadline per request (shard.guarded)."""
        # The longest any handler may take: a part stream lives for the round's all-reduce.
        return guarded(handler, streams=self.swarm.streams, admits=self.swarm.admits, reject=self.swarm.reject,
                       on_flood=self._flooded_by, limit=self.deadlines.ceiling + 3 * self.request_timeout,
                       request_timeout=self.request_timeout, max_header=max_header)

    async def _group_for(self, sender: str, header: dict) -> tuple[Group, int]:
        return await self.plane.group_for(sender, header)

    async def _on_begin(self, sender: str, header: dict, reader, writer) -> None:
        round = hfield(header, "r", int)
        members = hfield(header, "members", list)
        gid = hfield(header, "g", bytes)
        numel = hfield(header, "numel", int)
        lanes = hfield(header, "lanes", int)
        if not 1 <= lanes <= MAX_LANES:
            raise WireError("bad_field", "lanes")
        if not all(isinstance(m, str) for m in members) or members != sorted(set(members)):
            raise WireError("bad_members")
        owners = header.get("owners")
        if owners is not None and not (isinstance(owners, list) and all(isinstance(m, str) for m in owners)
                                       and owners == sorted(set(owners)) and set(owners) <= set(members)
                                       and 2 <= len(owners) < len(members)):
            raise WireError("bad_field", "owners")
        if sender != (owners or members)[0] or self.swarm.peer_id not in members:
            raise RoundFailed("not_a_member")
        if self.quarantine.quarantined(sender, time.monotonic()):
            await reply(writer, {"ok": False, "reason": "quarantined"})
            self._tell_refused(sender, round, members)
            return
        if sender in self._shunned(self.swarm.peers, time.monotonic()):
            await reply(writer, {"ok": False, "reason": "shunned"})
            return
        waiting = await self._waiting_for(round)
        if waiting is None:
            await reply(writer, {"ok": False, "reason": "not_waiting"})
            return
        if numel != waiting.flat.numel():
            raise RoundFailed("bad_size")
        ok, reason = accept_group(members, live_peers(self.swarm.peers, self.swarm.peer_id), self.min_peers)
        if not ok:  # a leader with a stale table, or one that lies, cannot make us commit as a minority
            log.info("round %d: refusing a group of %d from %s: %s", round + 1, len(members), sender[-8:], reason)
            await reply(writer, {"ok": False, "reason": reason})
            return
        if header.get("codec") != self.codec.name:
            await reply(writer, {"ok": False, "reason": "codec_mismatch"})
            return
        if waiting.state and header.get("h") != waiting.state:  # another lineage of this round number
            await reply(writer, {"ok": False, "reason": "state_mismatch"})
            return
        group = self._new_group(gid, round, members, waiting, lanes, owners)
        self._install(group)
        waiting.group.set_result(group)
        await reply(writer, {"ok": True})

    async def _waiting_for(self, round: int) -> _Waiting | None:
        """Our wait for a group of ``round``, if we are in one or about to be: a member whose last
        attempt just ended is on its way back (a moment), and a leader that was told at once
        would otherwise call its group off for that moment."""
        deadline = time.monotonic() + min(1.0, self.request_timeout / 4)
        while True:
            waiting = self._waiting
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

    async def _on_ready(self, sender: str, header: dict, reader, writer) -> None:
        round, state = hfield(header, "r", int), header.get("h", "")
        if not isinstance(state, str) or len(state) > 128:
            raise WireError("bad_field", "h")
        # One hint per peer (its latest), at most 4096 peers; only for the round we wait in.
        if round >= 0 and (self._waiting is None or round >= self._waiting.round):
            self._ready_hints[sender] = (round, state)
            self._wake.set()
        await reply(writer, {"ok": True})

    async def _on_vote(self, sender: str, header: dict, reader, writer) -> None:
        if "abort" in header and self.plane.ended(hfield(header, "g", bytes)):  # it ended here too: nothing to undo
            await reply(writer, {"ok": True})
            return
        group, index = await self._group_for(sender, header)
        if "abort" in header:
            group.aborted_by(sender, str(header["abort"])[:40], header.get("c"))
        else:
            group.add_vote(index, hfield(header, "digest", bytes))
        await reply(writer, {"ok": True})

    async def _on_dialback(self, sender: str, header: dict, reader, writer) -> None:
        await self.reachability.on_dialback(sender, header, reader, writer)

    async def _on_sign(self, sender: str, header: dict, reader, writer) -> None:
        """A member's signature on the certificate of a round we committed together (p2p/signing.py)."""
        refused = self.signing.receive(sender, hfield(header, "g", bytes), hfield(header, "pk", bytes),
                                       hfield(header, "sig", bytes), self.plane.group)
        if refused == "not_a_member":
            raise RoundFailed("not_a_member")
        await reply(writer, {"ok": not refused, **({"reason": refused} if refused else {})})

    def certify(self, prev: str, new: str):
        """After the last committed round is applied: sign its certificate (p2p/signing.py)."""
        return self.signing.certify(prev, new)


class _Behind(Exception):
    pass


def _hostile_input(flat: torch.Tensor, b: Behaviour) -> None:
    """Test-only (p2p/hostile.py): what a member that lies about its pseudo-gradient sends."""
    if b.scale is not None:
        flat.mul_(b.scale)
    if b.fill is not None:
        flat.fill_(b.fill)
