"""The donor's side of state transfer: serving the snapshot of the last committed round.

A peer asks for ``meta`` (round, params_hash, size, digest, shapes, chunk
digests), then byte ranges of the blob, and ``certs``, the chain of commit
certificates (p2p/commits.py) that leads to it; p2p/transfer.py is the asking
side and says how a download goes.

Serving is cheap for the donor: the snapshot is built once per state, when a
peer first asks for it, and requests only slice it, so a joiner never stalls
the donor's own averaging. Built on demand, not at every commit: joins are
rare, and a snapshot held all the time would be one more copy of θ and the
momentum (8 bytes per parameter) on every host for nothing.

A download that outlasts the donor's round goes on: the snapshot it began on
stays pinned (``MAX_PINNED``) while its ranges keep being asked for, and the
averages of the rounds committed since (p2p/averagelog.py, ``avg_meta`` and
``avg_range``) let the joiner catch up without downloading the state again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable

from p2p.averagelog import AverageLog
from p2p.commits import CommitLog, encode_certs
from p2p.faults import NO_FAULTS, Faults
from p2p.limits import BoundedDict, handler_deadline
from p2p.snapshot import Snapshot
from p2p.swarm import Swarm
from p2p.wire import (MAX_PAYLOAD_BYTES, SMALL_HEADER_BYTES, WireError, close_writer, field as hfield, linger,
                      read_frame, write_frame)

log = logging.getLogger(__name__)


# Older snapshots kept for downloads still under way (one more copy of the state each, held
# only while its ranges are asked for within ``PIN_IDLE_TIMEOUTS`` request timeouts).
MAX_PINNED = 1
PIN_IDLE_TIMEOUTS = 3


class StateServer:
    """Serves the latest snapshot to peers that ask for it, a snapshot a download began on while
    that download goes on, and the averages of the last rounds (``averages``)."""

    def __init__(self, swarm: Swarm, metrics, commits: CommitLog, *, faults: Faults = NO_FAULTS,
                 catchup_rounds: int = 0) -> None:
        self.swarm = swarm
        self.faults = faults  # test hooks (p2p/faults.py: ``serve``)
        self.metrics = metrics
        self.commits = commits
        self.snapshot: Snapshot | None = None
        self.averages = AverageLog(catchup_rounds)
        # Snapshots of states we left, with downloads of them under way: (round, hash) ->
        # (snapshot, when a range of it was last asked for).
        self._pinned: dict[tuple[int, str], tuple[Snapshot, float]] = {}
        self._served_at = 0.0  # when a range of ``snapshot`` was last asked for
        # The state changed and its snapshot is not built yet: how to build it (off the event
        # loop), and the build under way, if one is.
        self._build: Callable[[], Snapshot] | None = None
        self._building: asyncio.Future | None = None
        self.name = f"gonka.{swarm.scope}.state"
        # A multi-rank host: told who asked for the meta, before it is answered, so the other
        # ranks serve that peer their shards (node/ranks.py). Async callable(peer), or None.
        self.on_meta = None

    async def start(self) -> None:
        await self.swarm.p2p.add_binary_stream_handler(self.name, self._handle)

    def publish(self, build: Callable[[], Snapshot]) -> None:
        """The state changed: its snapshot is ``build()``, run when a peer first asks for it. The
        previous one goes now, unless a download of it is under way: it is pinned then (up to
        ``MAX_PINNED``), and a download of an older one ends with "moved_on"."""
        self._pin(self.snapshot, self._served_at)
        self.snapshot, self._build, self._building, self._served_at = None, build, None, 0.0

    def _idle(self, since: float) -> bool:
        """Nothing asked for a snapshot since ``since`` for too long to keep it."""
        return time.monotonic() - since > PIN_IDLE_TIMEOUTS * self.swarm.config.request_timeout

    def _pin(self, snap: Snapshot | None, served_at: float) -> None:
        for key, (_, at) in list(self._pinned.items()):
            if self._idle(at):
                del self._pinned[key]
        if snap is None or self._idle(served_at) or MAX_PINNED == 0:
            return
        self._pinned[(snap.round, snap.params_hash)] = (snap, served_at)
        while len(self._pinned) > MAX_PINNED:
            del self._pinned[min(self._pinned, key=lambda k: self._pinned[k][1])]

    def _serving(self, header: dict) -> Snapshot | None:
        """The snapshot a range request names: the current one or a pinned one."""
        key = (hfield(header, "round", int), hfield(header, "hash", str))
        snap = self.snapshot
        if snap is not None and (snap.round, snap.params_hash) == key:
            self._served_at = time.monotonic()
            return snap
        pinned = self._pinned.get(key)
        if pinned is None or self._idle(pinned[1]):
            return snap  # refused below as moved_on (or served if it is the current one)
        self._pinned[key] = (pinned[0], time.monotonic())
        return pinned[0]

    def serve(self, snapshot: Snapshot) -> None:
        """Serve ``snapshot`` as it is."""
        self.snapshot, self._build, self._building = snapshot, None, None
        self._pinned.clear()

    async def current(self, wait: float) -> Snapshot | None:
        """The snapshot of the state, built now if it is not yet; None if there is none, or if
        the build takes longer than ``wait`` (it goes on: the requester asks again)."""
        if self.snapshot is None and self._build is not None:
            if self._building is None:
                build = self._build
                self._building = asyncio.ensure_future(asyncio.to_thread(build))
                self._building.add_done_callback(lambda task: self._built(build, task))
            with contextlib.suppress(Exception):  # a timeout, or a failed build (logged by _built)
                await asyncio.wait_for(asyncio.shield(self._building), wait)
        return self.snapshot

    def _built(self, build, task: asyncio.Future) -> None:
        if self._build is not build:
            return  # the state changed while it was built: a snapshot of nothing we hold now
        self._building = None
        if task.cancelled() or task.exception() is not None:
            log.error("building the state snapshot failed: %r", None if task.cancelled() else task.exception())
            return
        self.snapshot, self._build = task.result(), None

    async def _handle(self, info, reader, writer) -> None:
        requester = info.peer_id.to_base58()
        if not self.swarm.streams.acquire(requester):
            self.swarm.reject("stream_flood", requester[-8:])
            await close_writer(writer)
            return
        try:
            if not await self.swarm.admits(requester):
                return  # counted as not_admitted: an outsider gets no byte of state
            async with handler_deadline(3 * self.swarm.config.request_timeout):
                await self._serve(requester, reader, writer)
        except WireError as e:
            self.swarm.reject(e.reason, str(e))
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # the requester went away, or we are shutting down
        except Exception as e:
            log.exception("state handler failed")
            self.swarm.reject("handler_error", repr(e))
        finally:
            self.swarm.streams.release(requester)
            await close_writer(writer)

    async def _serve(self, requester: str, reader, writer) -> None:
        """One request: the snapshot's meta, a range of it, or our certificate chain."""
        header, _ = await read_frame(reader, self.swarm.config.request_timeout, max_header=SMALL_HEADER_BYTES,
                                     max_payload=0)
        op = hfield(header, "op", str)
        # Only peers that announced themselves in this run's peer table get the state.
        if requester not in self.swarm.peers and requester not in await self.swarm.refresh_peers():
            self.swarm.reject("not_in_swarm", requester[-8:])
            await write_frame(writer, {"ok": False, "reason": "not_in_swarm"})
            return
        # A meta request is where a download starts: the snapshot is built for it if need be.
        if op == "meta":
            snap = await self.current(self.swarm.config.request_timeout / 2)
            self._served_at = time.monotonic()
        elif op == "range":
            snap = self._serving(header)
        else:
            snap = self.snapshot
        if op in ("avg_meta", "avg_range"):
            await serve_average(self.averages, op, header, reader, writer, self.metrics,
                                self.swarm.config.request_timeout)
        elif op == "certs":
            after = hfield(header, "after", int)
            certs = self.commits.after(after)
            payload = encode_certs(certs)
            if len(payload) > MAX_PAYLOAD_BYTES:  # a long chain in pieces: the requester asks again
                certs = certs[: max(1, len(certs) * MAX_PAYLOAD_BYTES // len(payload) // 2)]
                payload = encode_certs(certs)
            await write_frame(writer, {"ok": True, "n": len(certs)}, payload)
            await linger(reader, self.swarm.config.request_timeout)
        elif snap is None:  # none yet, or ours moved on since the requester's meta, or still building
            await write_frame(writer, {"ok": False, "reason": "no_state" if self._build is None else "moved_on"})
        elif op == "meta":
            if self.on_meta is not None:
                await self.on_meta(requester)
            await serve_meta(snap, reader, writer, self.swarm.config.request_timeout)
        elif op == "range":
            await serve_range(snap, header, reader, writer, self.metrics, self.swarm.config.request_timeout,
                              self.faults)
        else:
            raise WireError("bad_op")


async def serve_meta(snap: Snapshot, reader, writer, timeout: float) -> None:
    # The chunk digests travel as the payload: 16 bytes a chunk outgrow a header (64 KiB)
    # past ~1.9B parameters at the default chunk size.
    meta = {"ok": True, "round": snap.round, "hash": snap.params_hash, "size": len(snap.blob),
            "digest": snap.digest, "shapes": snap.shapes, "chunk": snap.chunk_bytes}
    if snap.shards:
        meta["shards"] = list(snap.shards)
    await write_frame(writer, meta, b"".join(snap.chunk_digests))
    await linger(reader, timeout)


async def serve_average(log: AverageLog, op: str, header: dict, reader, writer, metrics, timeout: float) -> None:
    """A round's average (p2p/averagelog.py): its piece table, or pieces [first, first + count)."""
    avg = log.get(hfield(header, "round", int))
    if avg is None:
        await write_frame(writer, {"ok": False, "reason": "no_average"})
        return
    if op == "avg_meta":
        table = await asyncio.to_thread(avg.table)
        if len(table) > MAX_PAYLOAD_BYTES:
            await write_frame(writer, {"ok": False, "reason": "too_many_pieces"})
            return
        await write_frame(writer, {"ok": True, "round": avg.round, "prev": avg.prev, "new": avg.new,
                                   "codec": avg.codec, "n": len(avg.pieces)}, table)
    else:
        first, count = hfield(header, "first", int), hfield(header, "count", int)
        if not (0 <= first and 0 < count and first + count <= len(avg.pieces)):
            raise WireError("bad_range")
        payloads = avg.payloads[first : first + count]
        if sum(len(p) for p in payloads) > MAX_PAYLOAD_BYTES:
            raise WireError("bad_range", "more than one frame")
        sent = await write_frame(writer, {"ok": True}, b"".join(payloads))
        metrics.sent_bytes.inc(sent)
    await linger(reader, timeout)


async def serve_range(snap: Snapshot, header: dict, reader, writer, metrics, timeout: float,
                      faults: Faults = NO_FAULTS) -> None:
    offset, length = hfield(header, "offset", int), hfield(header, "length", int)
    if hfield(header, "round", int) != snap.round or hfield(header, "hash", str) != snap.params_hash:
        await write_frame(writer, {"ok": False, "reason": "moved_on"})
        return
    if not (0 <= offset and 0 < length <= snap.chunk_bytes and offset + length <= len(snap.blob)):
        raise WireError("bad_range")
    faults.checkpoint("serve", snap.round + 1)
    sent = await write_frame(writer, {"ok": True}, memoryview(snap.blob)[offset : offset + length])
    metrics.sent_bytes.inc(sent)
    metrics.state_served.inc()
    await linger(reader, timeout)


class ShardStateServer:
    """Rank k's shard of a multi-rank host's snapshot, served to the peers rank 0 let in: rank 0
    checks the peer against the swarm (``StateServer``) and tells us before it answers the
    peer's meta request (``allow``), so a stranger gets no byte of any shard."""

    ALLOW_SECONDS = 600.0  # a joiner's download of one state, with its retries

    def __init__(self, p2p, name: str, streams, reject, metrics, request_timeout: float, *,
                 faults: Faults = NO_FAULTS) -> None:
        self.p2p = p2p
        self.faults = faults  # test hooks (p2p/faults.py: ``serve``)
        self.name = name
        self.streams = streams
        self.reject = reject
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.snapshot: Snapshot | None = None
        self._allowed: BoundedDict = BoundedDict(4096)  # peer -> until when

    def allow(self, peer: str) -> None:
        self._allowed[peer] = time.monotonic() + self.ALLOW_SECONDS

    async def start(self, guard) -> None:
        await self.p2p.add_binary_stream_handler(self.name, guard(self._serve))

    async def _serve(self, requester: str, header: dict, reader, writer) -> None:
        snap, op = self.snapshot, hfield(header, "op", str)
        if self._allowed.get(requester, 0.0) < time.monotonic():
            self.reject("not_in_swarm", requester[-8:])
            await write_frame(writer, {"ok": False, "reason": "not_in_swarm"})
        elif snap is None:
            await write_frame(writer, {"ok": False, "reason": "no_state"})
        elif op == "meta":
            await serve_meta(snap, reader, writer, self.request_timeout)
        elif op == "range":
            await serve_range(snap, header, reader, writer, self.metrics, self.request_timeout, self.faults)
        else:
            raise WireError("bad_op")
