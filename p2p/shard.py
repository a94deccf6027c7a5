"""One shard's data plane of a round: the group's all-reduce and audit of one vector.

A single-process host has one shard, its whole pseudo-gradient, and ``RoundProtocol``
(rounds.py) runs its plane next to the control plane (gather, begin, vote, certificates).
A multi-rank host (trainer/parallel.py) has one shard per rank: rank k runs the plane of
its shard in its own process, through the host's ``p2pd`` (same peer id), under request
names of its own (``...part.s{k}``), so the shards of all ranks travel in parallel and
rank k of a host only ever talks to rank k of the others. The control plane on rank 0
tells each rank which group to reduce (node/ranks.py), and the members vote on one digest
of all the shards' digests: a round commits for every shard or for none.

Everything here is per shard and knows nothing of the swarm beyond a way to open streams
(``Dialer``) and a way to count what it rejects.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Callable

import torch

from p2p.audit import PartAudit
from p2p.compression import base_vector, flatten, owned_bounds
from p2p.exchange import PartExchange, all_or_fail, off_loop
from p2p.failure import RoundFailed
from p2p.faults import NO_FAULTS, Faults
from p2p.feedback import ErrorFeedback
from p2p.group import Group
from p2p.lanes import LANES
from p2p.limits import BoundedDict, handler_deadline
from p2p.wire import (SMALL_HEADER_BYTES, FrameReader, WireError, close_writer, field as hfield, linger, read_frame,
                      reply, write_frame)

log = logging.getLogger(__name__)

DATA_REQUESTS = ("part", "audit", "evidence")


def combined_digest(shard_digests: list[bytes]) -> bytes:
    """What a multi-rank host votes: one digest over its shards' digests, in rank order."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)  # a vote's size (Group.add_vote)
    for d in shard_digests:
        h.update(len(d).to_bytes(2, "big") + d)
    return h.digest()


def shard_names(scope: str, requests, shard: int | None) -> dict[str, str]:
    """libp2p protocol names of ``requests``; a rank's shard has its own (``None``: rank 0's)."""
    suffix = "" if not shard else f".s{shard}"
    return {k: f"gonka.{scope}.{k}{suffix}" for k in requests}


# Requests answered at once: a call's time is one round trip (and a stream's opening) plus
# whatever the far end was busy with, so the least of a peer's last few is its round-trip time.
PROMPT_REQUESTS = frozenset({"ready", "vote", "refuse"})
RTT_SAMPLES = 8


class Dialer:
    """Requests out by name over one p2p handle: open a stream, send a frame, call and read; and
    each peer's round-trip time, as its prompt requests measure it (``rtt``)."""

    def __init__(self, p2p, names: dict[str, str], request_timeout: float, metrics,
                 connect_to: Callable | None = None) -> None:
        """``connect_to(peer)``: dial a peer from its signed heartbeat's addresses (rank 0 only;
        another rank reuses the connections of the host's p2pd)."""
        self.p2p = p2p
        self.names = names
        self.request_timeout = request_timeout
        self.metrics = metrics
        self.connect_to = connect_to
        self._rtts = BoundedDict(4096)  # peer -> seconds of its last RTT_SAMPLES prompt calls

    def rtt(self, peer: str) -> float | None:
        """The least time of ``peer``'s recent prompt calls (None before any): its round-trip time."""
        samples = self._rtts.get(peer)
        return min(samples) if samples else None

    async def open(self, peer: str, name: str):
        from p2p.swarm import peer_id_from

        try:
            async with asyncio.timeout(self.request_timeout):
                try:
                    info, reader, writer = await self.p2p.call_binary_stream_handler(peer_id_from(peer),
                                                                                      self.names[name])
                except Exception:
                    # p2pd may not know its addresses yet (we met it only through the DHT): dial the
                    # ones its own signed heartbeat gives, then try once more.
                    if self.connect_to is None or not await self.connect_to(peer):
                        raise
                    info, reader, writer = await self.p2p.call_binary_stream_handler(peer_id_from(peer),
                                                                                      self.names[name])
                return info, FrameReader.attach(reader, writer), writer
        except TimeoutError:
            raise RoundFailed("unreachable", peer[-8:], peer=peer) from None
        except Exception as e:
            raise RoundFailed("unreachable", f"{peer[-8:]}: {e!r}"[:200], peer=peer) from None

    async def send(self, peer: str, name: str, header: dict, payload: bytes) -> None:
        """A header, then one frame of payload; waits for the answer (or the request timeout)."""
        _, reader, writer = await self.open(peer, name)
        try:
            self.metrics.sent_bytes.inc(await write_frame(writer, header))
            self.metrics.sent_bytes.inc(await write_frame(writer, {}, payload))
            await read_frame(reader, self.request_timeout)
        finally:
            await close_writer(writer)

    async def call(self, peer: str, name: str, header: dict, timeout: float | None = None, max_payload: int = 0):
        started = time.monotonic()
        _, reader, writer = await self.open(peer, name)
        try:
            self.metrics.sent_bytes.inc(await write_frame(writer, header))
            answer = await read_frame(reader, timeout or self.request_timeout, max_payload=max_payload)
        finally:
            await close_writer(writer)
        if name in PROMPT_REQUESTS:
            samples = self._rtts.get(peer) or []
            self._rtts[peer] = [*samples[-(RTT_SAMPLES - 1):], time.monotonic() - started]
        return answer


def guarded(handler, *, streams, admits, reject, on_flood, limit: float, request_timeout: float,
            max_header: int | None = SMALL_HEADER_BYTES):
    """Wrap a stream handler: only admitted peers, a bounded number of streams per peer, one
    deadline (``limit``) for the whole exchange; count and drop anything malformed, always close
    the stream."""

    async def run(info, reader, writer):
        sender = info.peer_id.to_base58()
        if not streams.acquire(sender):
            reject("stream_flood", sender[-8:])
            on_flood(sender)
            await close_writer(writer)
            return
        try:
            if not await admits(sender):
                return  # counted as not_admitted
            async with handler_deadline(limit):
                reader = FrameReader.attach(reader, writer)
                header, _ = await read_frame(reader, request_timeout, max_payload=0,
                                             **({} if max_header is None else {"max_header": max_header}))
                await handler(sender, header, reader, writer)
                await linger(reader, request_timeout)
        except WireError as e:
            reject(e.reason, str(e))
        except RoundFailed as e:
            reject(e.reason, str(e))
            await reply(writer, {"ok": False, "reason": e.reason})
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # the node is shutting down: the stream goes with it
        except Exception as e:  # never let a peer crash the node
            log.exception("handler failed")
            reject("handler_error", repr(e))
        finally:
            streams.release(sender)
            await close_writer(writer)

    return run


class ShardPlane:
    """The groups of one shard: its round buffers, error feedback, the current group, and the
    requests of its all-reduce and audit (in and out)."""

    def __init__(self, *, me: str, codec, use_feedback: bool, aggregator: str, weight_cap: float, hostile,
                 feedback_decay: float = 1.0,
                 dial: Dialer, metrics, reject, offence, deadlines, request_timeout: float,
                 faults: Faults = NO_FAULTS) -> None:
        """``hostile`` and ``faults``: test hooks (p2p/hostile.py, p2p/faults.py), honest and none
        on a real node."""
        self.me = me
        self.codec = codec
        self.use_feedback = use_feedback
        self.aggregator = aggregator
        self.weight_cap = weight_cap
        self.feedback_decay = feedback_decay
        self.hostile = hostile
        self.dial = dial
        self.metrics = metrics
        self.reject = reject
        self.deadlines = deadlines
        self.request_timeout = request_timeout
        # What the codec dropped from our contributions, added back next round (lossy codecs only).
        self.feedback: ErrorFeedback | None = None
        # Where error feedback's residual lives: scratch(numel) -> a vector of zeros (memory-mapped
        # with outer.state_dir, trainer/hoststate.py); None: RAM. Set before the first round.
        self.scratch = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._donated = None  # weakref to the last donated vector, its residual added (``round_input``)
        self.group: Group | None = None
        self._group_set = asyncio.Event()
        self._ended: BoundedDict = BoundedDict(64)  # ids of our recent groups, over now
        self._left: Group | None = None  # the last of them, for evidence that comes after (_on_evidence)
        self.exchange = PartExchange(dial.open, metrics, reject, deadlines, faults)
        # Every member checks a sampled piece of another's part before it votes (p2p/audit.py).
        self.audits = PartAudit(codec, metrics, dial.call, dial.send, reject, offence, request_timeout)

    async def start(self, p2p, guard) -> None:
        """Serve this shard's requests; ``guard(handler)`` wraps each (``guarded``)."""
        await p2p.add_binary_stream_handler(self.dial.names["part"], guard(self._on_part))
        await p2p.add_binary_stream_handler(self.dial.names["audit"], guard(self._on_audit))
        await p2p.add_binary_stream_handler(self.dial.names["evidence"], guard(self._on_evidence))

    # ---- buffers -------------------------------------------------------------------

    def buffer(self, name: str, numel: int) -> torch.Tensor:
        """A vector of ``numel`` fp32 values kept from round to round: the round's copy of the
        pseudo-gradient when it is not donated (``flat``), what the receivers decode of our own
        part (``sent``, the size of that part) and, with error feedback, the next residual
        (``residual``: on commit it swaps with the current one).

        A fresh vector costs a page fault per 4 KB the first time each page is written (~25K per
        100 MB; on two shared cores a 25M-value round spent ~0.2 s of system time on them).
        Rounds on one peer are sequential, so one buffer of each is enough: the tensor work of
        an attempt that ended runs on the same single worker thread as the next round's (first
        the flatten), in submission order, and a failed attempt's leftovers never reach a result.
        """
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=torch.float32)
        return buf

    async def round_input(self, tensors: list[torch.Tensor], donate: bool) -> tuple[torch.Tensor, bool, bool]:
        """The vector a round of ``tensors`` reduces, error feedback's residual added once, and
        whether it was ``donated`` and is ``fresh`` (not given to an attempt before):
        ``(flat, donated, fresh)``. Donated (``RoundProtocol.average``): the tensors' own vector
        (``compression.base_vector``), the residual folded into it the first time only, which
        then is the residual's vector (``fold``); else a copy into the ``flat`` buffer, the
        residual added on the way, for every attempt. Copies and folds run off the event loop."""
        numel = sum(t.numel() for t in tensors)
        feedback = self.ensure_feedback(numel)
        residual = feedback.residual if feedback is not None else None
        flat = base_vector(tensors) if donate else None
        if flat is None:
            # A copy of ~4 bytes per parameter, the residual added on the way: not on the event loop.
            return await off_loop(flatten, tensors, self.buffer("flat", numel), residual), False, True
        fresh = self._donated is None or self._donated() is not flat
        if fresh:
            # Noted first: a cancelled wait does not stop the thread from adding it.
            self._donated = weakref.ref(flat)
            if residual is not None:
                # The residual's vector is ``flat`` from here on; the old one is given back.
                try:
                    await off_loop(self.fold, flat)
                except ValueError:  # a vector a round holds already, given again: nothing was added
                    self._donated = None
                    raise
        return flat, True, fresh

    def input_consumed(self) -> None:
        """The round of the last input committed: a vector given again is a new round's input."""
        self._donated = None

    def ensure_feedback(self, numel: int) -> ErrorFeedback | None:
        """The error-feedback residual for vectors of ``numel`` values (None if not used)."""
        if self.use_feedback and self.feedback is None:
            self.feedback = ErrorFeedback(numel, self.scratch)
        return self.feedback

    def delta_target(self) -> torch.Tensor | None:
        """``ErrorFeedback.target`` (None without feedback)."""
        return self.feedback.target if self.feedback is not None else None

    def fold(self, flat: torch.Tensor) -> None:
        """Error feedback's residual added into ``flat`` (a round's own vector: a donated
        pseudo-gradient, a rank's shard), which becomes the residual's storage; its groups then
        work in place (``Group.in_place``). Nothing without feedback. Tensor work."""
        if self.feedback is not None:
            self.feedback.fold(flat)

    def committed(self, group: Group) -> None:
        """The group's round committed: its residual is the one the next round adds back."""
        if self.feedback is not None and group.in_place:
            self.feedback.settle()
        elif self.feedback is not None and group.residual is not self.feedback.residual:
            # Only a committed round consumes the residual; the old one's buffer is next.
            self._buffers["residual"] = self.feedback.adopt(group.residual)

    # ---- groups --------------------------------------------------------------------

    def new_group(self, gid: bytes, round: int, members: list[str], flat: torch.Tensor, weight: float,
                  residual_added: bool = True, lanes: int = LANES, owners: list[str] | None = None,
                  factors: list[float] | None = None, checks: list | None = None) -> Group:
        """A group reducing ``flat``. ``residual_added``: error feedback's residual was folded into
        ``flat`` once, for every attempt of the round (``fold``: a donated pseudo-gradient, a
        rank's shard), and ``flat`` is the residual's vector now: the group works in place
        (``Group.in_place``): an attempt leaves ``flat`` as it is, and a commit writes the next
        residual over it (``Group.write_residual``). Otherwise (a copy made per attempt,
        adding the residual each time) the next residual goes to a buffer of its own, adopted
        on commit."""
        numel = flat.numel()
        members = sorted(members)
        start, end = owned_bounds(numel, [owners is None or m in owners for m in members])[members.index(self.me)]
        residual = None
        if self.use_feedback:
            feedback = self.ensure_feedback(numel)
            residual = feedback.residual if residual_added else self.buffer("residual", numel)
        in_place = residual is not None and residual is flat
        sent = None if self.codec.exact or in_place else self.buffer("sent", end - start)  # our own part only
        return Group(gid, round, members, self.me, flat, weight, self.codec, residual, sent,
                     aggregator=self.aggregator, weight_cap=self.weight_cap, feedback_decay=self.feedback_decay,
                     hostile=self.hostile, lanes_per_part=lanes,
                     owners=owners, factors=factors, checks=list(checks or []))

    def install(self, group: Group) -> None:
        self.group = group
        self._group_set.set()

    def leave(self, group: Group) -> None:
        """The attempt is over: requests naming it are answered at once from now on."""
        self._ended[group.id] = True
        self._left = group
        if self.group is group:
            self.group = None

    def ended(self, gid: bytes) -> bool:
        return gid in self._ended

    async def reduce(self, group: Group, deadline: float) -> bytes:
        """The all-reduce of this shard and this member's audit of it; returns the shard's digest.
        A member votes only once its own audit is clean: all votes in and equal means every
        sampled piece was recomputed and matched, and nobody applies anything otherwise. The
        audit starts once the part it samples is in, while the other parts still land."""
        others = [p for p in group.members if p != group.me]
        exchange = asyncio.ensure_future(self.exchange.run(group, deadline))
        exchange.add_done_callback(lambda _: group.mark("exchanged"))
        await all_or_fail([exchange, asyncio.ensure_future(self.audits.check_when_placed(group, others, deadline))],
                          group)
        group.mark("audited")
        return group.digest()

    async def group_for(self, sender: str, header: dict, *, left_too: bool = False) -> tuple[Group, int]:
        """The current group named by the header, with the sender's index; refuse strangers.
        ``left_too``: the group this member left last, if it is the one named."""
        gid = hfield(header, "g", bytes)
        deadline = time.monotonic() + self.request_timeout
        left = self._left if left_too and self._left is not None and self._left.id == gid else None
        while left is None and (self.group is None or self.group.id != gid):
            # A member may hear from another member before its own group is installed.
            if gid in self._ended or time.monotonic() > deadline:
                raise RoundFailed("unknown_group")
            self._group_set.clear()
            try:
                async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                    await self._group_set.wait()
            except TimeoutError:
                pass
        group = left or self.group
        index = group.member_index(sender)
        if index is None:
            raise RoundFailed("not_a_member")
        return group, index

    # ---- requests in -----------------------------------------------------------------

    async def _on_part(self, sender: str, header: dict, reader, writer) -> None:
        group, index = await self.group_for(sender, header)
        await self.exchange.serve(group, index, header, reader, writer)

    async def _on_evidence(self, sender: str, header: dict, reader, writer) -> None:
        # An auditor fails the attempt and then sends its evidence: the abort may reach this member
        # first, and it leaves the group. The evidence is checked against the group it names all
        # the same (the last one left, so one group's buffers at most are kept), or every member
        # but the auditor would let the owner's lie go.
        group, _ = await self.group_for(sender, header, left_too=True)
        await self.audits.on_evidence(group, sender, header, reader, writer)

    async def _on_audit(self, sender: str, header: dict, reader, writer) -> None:
        group, _ = await self.group_for(sender, header)
        await self.audits.on_audit(group, header, writer)
