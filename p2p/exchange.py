"""The data half of a round: the butterfly all-reduce's streams for one agreed group.

On the wire, member i opens ``part`` streams ("lanes", ``Group.lanes``) to
every other member j; on lane l it sends a header (group, weight, sizes,
lane) and then its pieces k of part j with k % lanes == l; on the same stream
j sends back each of those pieces averaged as soon as every member's copy of
it is in, or ``{"ok": false, "reason": ...}`` once the attempt failed. Both
directions run at once, so averaged pieces travel while later pieces are
still arriving. ``RoundProtocol`` (rounds.py) forms the group, hands the
streams of its members here, and runs the vote afterwards.

The tensor work runs on one worker thread (``off_loop``) while the event loop
keeps every stream moving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

import torch

from p2p.failure import RoundFailed
from p2p.faults import NO_FAULTS, Faults
from p2p.group import Group
from p2p.wire import SMALL_HEADER_BYTES, WireError, close_writer, field as hfield, read_frame, reply, write_frame

log = logging.getLogger(__name__)


class PartExchange:
    """Moves one group's parts: ``run`` from the requester's side, ``serve`` from the owner's."""

    def __init__(self, open_stream, metrics, reject, deadlines, faults: Faults = NO_FAULTS) -> None:
        """``open_stream(peer, "part")`` opens a stream to a member; ``reject(reason, detail)`` counts
        malformed input; ``deadlines.deadline()`` bounds an owner's side of the exchange;
        ``faults``: test hooks (p2p/faults.py: ``reduce``, ``gather``)."""
        self._open_stream = open_stream
        self.faults = faults
        self.metrics = metrics
        self._reject = reject
        self.deadlines = deadlines

    async def run(self, group: Group, deadline: float) -> None:
        """Return once ``group.result`` holds the whole average (every member's part placed)."""
        group.deadline = deadline
        exchanges = [self._exchange(group, j, lane, deadline)
                     for j in group.owner_indices() if j != group.index for lane in range(group.lanes(j))]
        own = [self._contribute_own(group), group.all_reduced(deadline)]
        await all_or_fail([asyncio.ensure_future(c) for c in [*own, *exchanges]], group)

    async def _exchange(self, group: Group, j: int, lane: int, deadline: float) -> None:
        """Stream our pieces of member j's part on ``lane`` to j while j streams them back averaged."""
        _, reader, writer = await self._open_stream(group.members[j], "part")
        try:
            header = {"g": group.id, "w": group.claimed_weight, "nbytes": group.wire_bytes(j),
                      "numel": group.flat.numel(), "lane": lane}
            self.metrics.sent_bytes.inc(await write_frame(writer, header))
            sending = asyncio.ensure_future(self._send_pieces(group, j, lane, writer))
            receiving = asyncio.ensure_future(self._receive_average(group, j, lane, reader, deadline))
            await all_or_fail([sending, receiving], group, by=group.members[j])
        finally:
            await close_writer(writer)

    async def _send_pieces(self, group: Group, j: int, lane: int, writer) -> None:
        """Our contribution to part j's pieces of ``lane``, piece by piece (encoded off the event loop)."""
        loop = asyncio.get_running_loop()
        for k in group.lane_pieces(j, lane):
            payload = await off_loop(group.encode_piece, j, k)
            self.metrics.sent_bytes.inc(await write_frame(writer, {}, payload,
                                                          timeout=max(0.1, group.deadline - loop.time())))
        self.faults.checkpoint("reduce", group.round + 1, len(group.members))

    async def _receive_average(self, group: Group, j: int, lane: int, reader, deadline: float) -> None:
        """Member j's averaged pieces of its part on ``lane``, into our result; count whatever is malformed."""
        for k in group.lane_pieces(j, lane):
            expected = group.average_bytes(j, k)
            try:
                # The owner's header declares every member's input (p2p/digests.py, 24 bytes each).
                header, payload = await self._read_payload(reader, expected, deadline,
                                                           SMALL_HEADER_BYTES + 32 * len(group.members))
            except WireError as e:
                if e.reason in MALFORMED:  # not for a peer that is merely slow or gone
                    self._reject(e.reason, str(e))
                raise
            if header.get("ok") is False:  # j gave up on the round; its words are a detail, not a reason
                raise RoundFailed("peer_failed", str(header.get("reason"))[:40])
            try:
                if len(payload) != expected:
                    raise WireError("bad_size", f"averaged piece of {len(payload)} bytes, expected {expected}")
                declared = header.get("in")
                if not isinstance(declared, bytes):
                    raise RoundFailed("owner_misreported", "no declaration of the piece's inputs")
                group.audit.check_declaration(j, k, declared)
                await off_loop(group.place_piece, j, k, payload, declared)
                group.wake()  # for whoever waits on the piece (an audit, evidence)
            except (WireError, RoundFailed) as e:
                self._reject(e.reason, str(e))
                group.blame.setdefault(group.members[j], e.reason)
                raise
        self.faults.checkpoint("gather", group.round + 1, len(group.members))

    async def _read_payload(self, reader, nbytes: int, deadline: float,
                            max_header: int = SMALL_HEADER_BYTES) -> tuple[dict, bytes]:
        """One frame of at most ``nbytes`` payload bytes, within the round's deadline."""
        loop = asyncio.get_running_loop()
        header, payload = await read_frame(reader, max(0.1, deadline - loop.time()), max_payload=nbytes,
                                           max_header=max_header)
        self.metrics.received_bytes.inc(len(payload))
        return header, payload

    async def _contribute_own(self, group: Group) -> None:
        """Our own slice of our part: encoded like everyone's, so we average what we send."""
        for k in range(len(group.pieces[group.index])):
            payload = await off_loop(group.encode_piece, group.index, k)
            await self._add_piece(group, group.index, k, await off_loop(group.own_input, k, payload))

    async def _add_piece(self, group: Group, sender: int, k: int, values: torch.Tensor | bytes) -> None:
        """Store a piece of our part; the contribution that completes piece k averages it."""
        if group.part.add_piece(sender, k, values):
            try:
                group.set_reduced(k, await off_loop(group.reduce_piece, k))
            except RoundFailed as e:  # not the sender's fault: fail the round, not the stream
                group.fail(e.reason, str(e))

    async def serve(self, group: Group, index: int, header: dict, reader, writer) -> None:
        """Member ``index`` of ``group`` opened a part stream to us (header read): take its pieces of
        our part and stream the averaged pieces back."""
        weight = hfield(header, "w", float)
        nbytes = hfield(header, "nbytes", int)
        lane = hfield(header, "lane", int)
        try:
            if hfield(header, "numel", int) != group.flat.numel() or nbytes != group.wire_bytes(group.index):
                raise RoundFailed("bad_size")
            group.part.add_lane(index, lane, weight)
        except RoundFailed as e:
            group.blame.setdefault(group.members[index], e.reason)
            group.fail(e.reason)
            raise
        if group.weight_cap and weight > group.weight_cap and lane == 0:  # counted, not refused: it is capped
            self._reject("weight_capped", f"{weight:.3g} tokens claimed, {group.weight_cap:.3g} allowed")
            group.blame.setdefault(group.members[index], "weight_capped")
        deadline = asyncio.get_running_loop().time() + self.deadlines.deadline(group.rtt)
        receiving = asyncio.ensure_future(self._receive_pieces(group, index, lane, reader, deadline))
        try:
            async with asyncio.timeout_at(deadline):  # also bounds writes to a requester that stopped reading
                for k in group.lane_pieces(group.index, lane):
                    data, declared = await group.reduced_piece(k, deadline)
                    self.metrics.sent_bytes.inc(await write_frame(
                        writer, {"in": declared}, data, timeout=max(0.1, deadline - asyncio.get_running_loop().time())))
        except (RoundFailed, TimeoutError) as e:
            if receiving.done() and not receiving.cancelled() and receiving.exception() is not None:
                raise receiving.exception() from None  # the sender's own input failed the round: count it
            await reply(writer, {"ok": False, "reason": getattr(e, "reason", "timeout")})
        finally:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)

    async def _receive_pieces(self, group: Group, index: int, lane: int, reader, deadline: float) -> None:
        """Member ``index``'s pieces of our part on ``lane``; anything wrong fails the round at once."""
        try:
            for k in group.lane_pieces(group.index, lane):
                expected = group.piece_bytes(group.index, k)
                _, payload = await self._read_payload(reader, expected, deadline)
                if len(payload) != expected:
                    raise WireError("bad_size", f"piece of {len(payload)} bytes, expected {expected}")
                await self._add_piece(group, index, k, await off_loop(group.check_piece, k, payload, index))
        except (WireError, RoundFailed) as e:
            if e.reason not in ("timeout", "truncated"):  # not for a member that is merely slow or gone
                group.blame.setdefault(group.members[index], e.reason)
            group.fail(e.reason, str(e), by=group.members[index])
            raise


# One worker thread runs the rounds' tensor work (encode, decode, average, digest): the
# event loop keeps every stream moving meanwhile, and pieces never compete with each
# other for the cores (inside each op torch still uses its intra-op threads).
_TENSOR_WORK = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gonka-allreduce")


async def off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_TENSOR_WORK, fn, *args)



# Frames a peer got wrong (counted as rejected), as opposed to a peer that was slow or gone.
MALFORMED = frozenset({"oversized_header", "oversized_payload", "bad_header"})



async def all_or_fail(tasks: list[asyncio.Future], group: Group, by: str | None = None) -> None:
    """Await all tasks; on the first failure cancel the rest, fail the group (``by``: the member
    whose streams the tasks are), raise RoundFailed."""
    try:
        for fut in asyncio.as_completed(tasks):
            await fut
    except BaseException as e:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(e, asyncio.CancelledError):
            raise
        if isinstance(e, (RoundFailed, WireError)):
            reason = e.reason
        elif isinstance(e, (ConnectionError, OSError, asyncio.IncompleteReadError)):
            reason = "connection_lost"
        else:
            log.exception("unexpected error in a round")
            reason = "error"
        group.fail(reason, str(e), by=by or getattr(e, "peer", None))
        raise RoundFailed(reason, str(e)[:200]) from None
