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

``RoundProtocol`` carries the round out and owns the pieces it decides with:
``GroupFormation`` (p2p/formation.py: the wait, ready hints, gather, the leader's
``begin`` and a member's answer; its decisions are ``Gathering``'s, p2p/gathering.py),
``Conduct (p2p/conduct.py: strikes, quarantine, refusals, whom to leave out),
``VoteExchange`` (p2p/votes.py: votes and aborts between members), and the
shard's data plane (p2p/shard.py). Test hooks (p2p/faults.py, p2p/hostile.py)
are handed to its constructor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from p2p.codecs import get_codec
from p2p.commits import CommitLog
from p2p.compression import CommittedAverage
from p2p.conduct import Conduct
from p2p.deadline import DeadlinePolicy
from p2p.exchange import all_or_fail, off_loop
from p2p.failure import RoundFailed
from p2p.faults import NO_FAULTS, Faults
from p2p.feedback import ErrorFeedback
from p2p.formation import Behind, GroupFormation, Wait
from p2p.group import Group
from p2p.hostile import HONEST, Behaviour, corrupt, flood as hostile_flood
from p2p.reachability import Reachability
from p2p.shard import DATA_REQUESTS, Dialer, ShardPlane, combined_digest, guarded, shard_names
from p2p.checks import CheckBook
from p2p.ledger import Entry
from p2p.signing import CommitSigning
from p2p.swarm import Swarm
from p2p.votes import VoteExchange
from p2p.wire import SMALL_HEADER_BYTES, WireError, field as hfield, reply

log = logging.getLogger(__name__)

# The control plane's requests; a shard's all-reduce and audit are its own (p2p/shard.py).
CONTROL_REQUESTS = ("begin", "vote", "ready", "sign", "refuse", "dialback", "input", "check")


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
        self._background_tasks: set[asyncio.Task] = set()
        # The members' votes on a group's result, and the word that an attempt is off (p2p/votes.py).
        self.votes = VoteExchange(self._call, self._background)
        # Whom we hold to account and leave out of our groups (p2p/conduct.py).
        self.conduct = Conduct(swarm, metrics, background=self._background,
                               tell=lambda peer, leader: self._call(peer, "refuse", {"leader": leader}))
        self.deadlines = DeadlinePolicy(ceiling=cfg.round_timeout, floor=min(5.0, cfg.round_timeout))
        self.codec = get_codec(cfg.codec)
        self.request_timeout = cfg.request_timeout
        self._names = shard_names(swarm.scope, CONTROL_REQUESTS + DATA_REQUESTS, None)
        self.dial = Dialer(swarm.p2p, self._names, cfg.request_timeout, metrics, swarm.connect_to)
        # This host's shard of every round (its whole pseudo-gradient on a single-rank host).
        self.plane = ShardPlane(me=swarm.peer_id, codec=self.codec,
                                use_feedback=cfg.error_feedback and self.codec.name != "fp32",
                                aggregator=cfg.aggregator, weight_cap=weight_cap, hostile=hostile, faults=faults,
                                feedback_decay=cfg.error_feedback_decay,
                                dial=self.dial, metrics=metrics, reject=swarm.reject, offence=self.conduct.offence,
                                deadlines=self.deadlines, request_timeout=cfg.request_timeout)
        # The other ranks' shards of a multi-rank host (node/ranks.py), reduced in the same groups.
        self.shards = None
        self.last = RoundOutcome("none")
        self._flood_task: asyncio.Task | None = None
        self._lies: dict = {}  # test-only: what a replaying liar keeps (p2p/hostile.py)
        # Whether peers can dial this node (p2p/reachability.py); asked by the node, answered here.
        self.reachability = Reachability(swarm, lambda peer, header, timeout: self._call(peer, "dialback", header,
                                                                                         timeout),
                                         cfg.request_timeout)
        # Checks of sampled members' updates against their assigned data (p2p/checks.py).
        self.checks = CheckBook(swarm, self.commits, self._call, metrics, cfg.checked_members, cfg.request_timeout)
        # How this peer gets into a group of a round (p2p/formation.py).
        self.formation = GroupFormation(swarm, self.plane, self.conduct, self.votes, self.reachability, metrics,
                                        call=self._call, background=self._background, standing=self.commits.standing,
                                        checks=self.checks)

    async def start(self) -> None:
        kernels = getattr(self.codec, "kernels", None)
        if kernels is not None:  # build or load a 4-bit codec's C kernels now, not inside the first round
            await asyncio.to_thread(kernels)
        p2p = self.swarm.p2p
        # A begin lists every member; every other request is a handful of fields.
        await p2p.add_binary_stream_handler(self._names["begin"], self._guard(self.formation.on_begin,
                                                                              max_header=None))
        handlers = {"vote": self._on_vote, "ready": self.formation.on_ready, "sign": self._on_sign,
                    "refuse": self._on_refuse, "dialback": self.reachability.on_dialback,
                    "input": self.checks.on_input, "check": self.checks.on_check}
        assert set(handlers) == set(CONTROL_REQUESTS[1:])
        for name, handler in handlers.items():
            await p2p.add_binary_stream_handler(self._names[name], self._guard(handler))
        await self.plane.start(p2p, self._guard)
        if self.hostile.flood:
            self.flood()

    def flood(self) -> None:
        """Test-only (p2p/hostile.py): open streams to every peer and never write a byte on them."""
        self._flood_task = asyncio.ensure_future(hostile_flood(lambda: self.swarm.refresh_peers(max_age=1.0),
                                                               self._open))

    # ---- the averaging interface ---------------------------------------------------

    # The shard's settings, read by every new group: test-only lies (p2p/hostile.py; honest
    # unless set), the cap on a member's weight, how part owners combine contributions.
    hostile = property(lambda self: self.plane.hostile, lambda self, v: setattr(self.plane, "hostile", v))
    weight_cap = property(lambda self: self.plane.weight_cap, lambda self, v: setattr(self.plane, "weight_cap", v))
    aggregator = property(lambda self: self.plane.aggregator)
    # The fewest peers a round may have (a test may lower it on a live node); read by the formation.
    min_peers = property(lambda self: self.formation.min_peers,
                         lambda self, v: setattr(self.formation, "min_peers", v))
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
        flat, donated, fresh = await self.plane.round_input(tensors, donate)
        if self.hostile.any and fresh:
            await off_loop(corrupt, flat, self.hostile, round, self._lies)
        # Not ready before we know whether peers can dial us (a moment, once: p2p/reachability.py).
        await self.reachability.settled()
        started = time.monotonic()
        wait = Wait(round, flat, float(weight), asyncio.get_running_loop().create_future(), state, donated)
        try:
            group = await self.formation.form(wait, started)
        except Behind:
            self.last = RoundOutcome("behind", "swarm_ahead", gather_seconds=time.monotonic() - started)
            return None
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
            await asyncio.shield(self.votes.abort(group, reason))
            if self.shards is not None:
                await asyncio.shield(self.shards.end(group, committed=False))
            self.metrics.averaging_failures.labels(reason=reason).inc()
            self.last = RoundOutcome("aborted", reason, group.id.hex()[:8], group.members,
                                     gathered - started, time.monotonic() - gathered, self.conduct.judge(group),
                                     group.phases(gathered))
            log.warning("round %d attempt %s with %d members aborted: %s", round + 1, group.id.hex()[:8],
                        len(group.members), e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return None
        finally:
            self._leave(group)
        blamed = self.conduct.judge(group)
        seconds = time.monotonic() - gathered
        # The round's ledger entry (p2p/ledger.py): what our certificate will cover.
        built = time.perf_counter()
        entry = await asyncio.shield(off_loop(group.ledger_entry))
        self.metrics.scoring_seconds.labels(part="gram").inc(group.gram_seconds)
        self.metrics.scoring_seconds.labels(part="entry").inc(time.perf_counter() - built)
        self.commits.record(entry)
        self._account(entry)
        self.checks.committed(group, entry)
        self.signing.committed(group.id, group.members, round + 1, [group.members[i] for i in group.voters()], entry)
        if group.residual_to_write:  # what the round did not deliver of what we sent, for the next one
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
        self.plane.input_consumed()
        return group.committed_average(tensors, out)

    def _account(self, entry: Entry) -> None:
        """Metrics and a log line of a committed round's ledger entry (p2p/ledger.py)."""
        for row in entry.rows:
            for flag in row.flags:
                self.metrics.ledger_flags.labels(flag=flag).inc()
            if row.peer == self.swarm.peer_id:
                self.metrics.credit.inc(row.credit)
        self.metrics.standing.set(self.commits.standing(entry.round).factor(self.swarm.peer_id))
        flagged = [f"{r.peer[-8:]}:{'+'.join(r.flags)}" for r in entry.rows if r.flags]
        log.info("ledger round=%d agreement=%s work=%s%s", entry.round,
                 "/".join(f"{r.agreement:.3f}" for r in entry.rows), "/".join(f"{r.work:.2f}" for r in entry.rows),
                 f" flagged {' '.join(flagged)}" if flagged else "")

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

    def _leave(self, group: Group) -> None:
        """The attempt is over: requests naming it are answered at once from now on."""
        self.plane.leave(group)

    # ---- all-reduce and vote ----------------------------------------------------------

    async def _allreduce(self, group: Group) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadlines.deadline(group.rtt)
        if self.hostile.abort:
            raise RoundFailed("hostile")  # test-only: a member that aborts every group it joins
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
        await self.votes.vote(group, vote, deadline)

    # ---- requests out ------------------------------------------------------------------

    async def _open(self, peer: str, name: str):
        return await self.dial.open(peer, name)

    async def _call(self, peer: str, name: str, header: dict, timeout: float | None = None, max_payload: int = 0):
        return await self.dial.call(peer, name, header, timeout, max_payload)

    # ---- requests in -------------------------------------------------------------------

    def _guard(self, handler, max_header: int | None = SMALL_HEADER_BYTES):
        """Only admitted peers, bounded streams per peer, one deadline per request (shard.guarded)."""
        # The longest any handler may take: a part stream lives for the round's all-reduce.
        return guarded(handler, streams=self.swarm.streams, admits=self.swarm.admits, reject=self.swarm.reject,
                       on_flood=self.conduct.flooded_by, limit=self.deadlines.ceiling + 3 * self.request_timeout,
                       request_timeout=self.request_timeout, max_header=max_header)

    async def _group_for(self, sender: str, header: dict) -> tuple[Group, int]:
        return await self.plane.group_for(sender, header)

    async def _on_vote(self, sender: str, header: dict, reader, writer) -> None:
        if "abort" in header and self.plane.ended(hfield(header, "g", bytes)):  # it ended here too: nothing to undo
            await reply(writer, {"ok": True})
            return
        group, index = await self._group_for(sender, header)
        self.votes.received(group, sender, index, header)
        await reply(writer, {"ok": True})

    async def _on_sign(self, sender: str, header: dict, reader, writer) -> None:
        """A member's signature on the certificate of a round we committed together (p2p/signing.py)."""
        refused = self.signing.receive(sender, hfield(header, "g", bytes), hfield(header, "pk", bytes),
                                       hfield(header, "sig", bytes), self.plane.group)
        if refused == "not_a_member":
            raise RoundFailed("not_a_member")
        await reply(writer, {"ok": not refused, **({"reason": refused} if refused else {})})

    async def _on_refuse(self, sender: str, header: dict, reader, writer) -> None:
        leader = hfield(header, "leader", str)
        if len(leader) > 128 or leader == sender:
            raise WireError("bad_field", "leader")
        self.conduct.told_us(sender, leader)
        await reply(writer, {"ok": True})

    def certify(self, prev: str, new: str):
        """After the last committed round is applied: sign its certificate (p2p/signing.py)."""
        return self.signing.certify(prev, new)
