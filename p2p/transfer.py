"""State transfer: how a joining or diverged peer gets the swarm's global state.

The state is one blob: the global parameters then the outer momentum, fp32,
in model order, plus the round number. Every donor serves the snapshot of its
last committed round: ``meta`` (round, params_hash, size, digest, shapes),
byte ranges of the blob, and ``certs``, its chain of commit certificates
(``commits.py``). A receiver follows only the (round, params_hash) a majority
of the other live peers announce (``quorum.follow``), and only with a chain
of certificates from a state it trusts (``fetch_chain``); it downloads chunks
from all donors holding it in parallel, hands a dead donor's chunks to the
others, and verifies the blob digest before anyone loads it (the caller then
checks ``params_hash`` too).

Serving is cheap for the donor: the snapshot is built once per state, when a
peer first asks for it, and requests only slice it, so a joiner never stalls
the donor's own averaging. Built on demand, not at every commit: joins are
rare, and a snapshot held all the time would be one more copy of θ and the
momentum (8 bytes per parameter) on every host for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from p2p.faults import NO_FAULTS, Faults
from p2p.config import MIN_STATE_CHUNK_BYTES
from p2p.commits import CommitCertificate, CommitLog, decode_certs, encode_certs, verify_chain
from p2p.swarm import Swarm, peer_id_from
from p2p.limits import BoundedDict, handler_deadline
from p2p.wire import (MAX_PAYLOAD_BYTES, SMALL_HEADER_BYTES, WireError, close_writer, field as hfield, linger,
                      read_frame, write_frame)

log = logging.getLogger(__name__)

CERT_WAIT_SECONDS = 3.0  # how long a chain missing only its newest certificate is asked for again
CERT_POLL_SECONDS = 0.25
DIGEST_BYTES = 16  # blake2b-128 of the whole blob and of each chunk
# Chunk requests in flight to one donor, and to all together. Each request is a new stream whose
# window starts small (256 KiB in yamux) and doubles each round trip, so one at a time carried a
# 4 MiB chunk in ~5 round trips: ~27 Mbit/s from one donor at 250 ms. Eight per donor keep up to
# 32 MiB in flight, a 1 Gbit/s link's bandwidth-delay product at 250 ms; the total bounds the
# receiver's buffers (32 chunks: 128 MiB at the default chunk size).
PULLS_PER_DONOR = 8
MAX_PULLS = 32
MAX_SHARDS = 1024  # ranks of one host (host.nproc_per_node's bound)


@dataclass(slots=True, frozen=True)
class Snapshot:
    """An immutable copy of the global state at one committed round."""

    round: int
    params_hash: str
    shapes: list[list[int]]
    blob: bytes | memoryview  # fp32 values, bytes as they go on the wire
    digest: bytes
    # The blob is served in pieces of chunk_bytes; the digest of every piece lets a
    # receiver check each one as it arrives.
    chunk_bytes: int
    chunk_digests: list[bytes]
    # A multi-rank host's snapshot is its rank's shard of the state; rank 0's also lists every
    # shard's hash (in rank order), which ``params_hash`` is the combined hash of.
    shards: tuple[str, ...] = ()

    @classmethod
    def build(cls, round: int, params_hash: str, params: list[torch.Tensor], momentum: list[torch.Tensor],
              chunk_bytes: int, shards: tuple[str, ...] = ()) -> "Snapshot":
        # One copy of the state, in place: the blob is a byte view of it, not another copy.
        tensors = [*params, *momentum]
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
        offset = 0
        for t in tensors:
            flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        blob = memoryview(flat.numpy()).cast("B")
        return cls(round, params_hash, [list(p.shape) for p in params], blob, _digest(blob), chunk_bytes,
                   _chunk_digests(blob, chunk_bytes), tuple(shards))

    def unpack(self) -> dict:
        """The blob back as {'round', 'params', 'momentum'} tensors."""
        flat = torch.frombuffer(bytearray(self.blob), dtype=torch.float32)
        tensors, offset = [], 0
        for shape in self.shapes * 2:
            n = _numel(shape)
            tensors.append(flat[offset : offset + n].view(shape).clone())
            offset += n
        half = len(self.shapes)
        return {"round": self.round, "params": tensors[:half], "momentum": tensors[half:]}


class StateServer:
    """Serves the latest snapshot to peers that ask for it."""

    def __init__(self, swarm: Swarm, metrics, commits: CommitLog, *, faults: Faults = NO_FAULTS) -> None:
        self.swarm = swarm
        self.faults = faults  # test hooks (p2p/faults.py: ``serve``)
        self.metrics = metrics
        self.commits = commits
        self.snapshot: Snapshot | None = None
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
        previous one goes now (a download of it ends with "moved_on")."""
        self.snapshot, self._build, self._building = None, build, None

    def serve(self, snapshot: Snapshot) -> None:
        """Serve ``snapshot`` as it is."""
        self.snapshot, self._build, self._building = snapshot, None, None

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
        snap = await self.current(self.swarm.config.request_timeout / 2) if op == "meta" else self.snapshot
        if op == "certs":
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


class NoChain(RuntimeError):
    """No donor showed a certificate chain to the state; ``liars``: the donors that sent a
    certificate no honest peer holds (a signature that does not verify). A chain that is only
    missing links proves nothing: honest peers lack the newest certificate for a moment, and
    one they never completed (a member's signature lost)."""

    def __init__(self, message: str, liars: list[str]) -> None:
        super().__init__(message)
        self.liars = liars


class StateDownload:
    """Fetch one snapshot from several donors in parallel; see the module docstring."""

    def __init__(self, swarm: Swarm, metrics, name: str) -> None:
        self.p2p, self.reject, self.timeout = swarm.p2p, swarm.reject, swarm.config.request_timeout
        self.metrics = metrics
        self.name = name

    @classmethod
    def through(cls, p2p, reject, request_timeout: float, metrics, name: str) -> "StateDownload":
        """A download on a handle other than the swarm's (a multi-rank host's other ranks)."""
        self = cls.__new__(cls)
        self.p2p, self.reject, self.timeout = p2p, reject, request_timeout
        self.metrics, self.name = metrics, name
        return self

    async def _request(self, donor: str, header: dict, max_payload: int = 0) -> tuple[dict, bytes]:
        async with asyncio.timeout(self.timeout):
            _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id_from(donor), self.name)
        try:
            await write_frame(writer, header)
            reply, payload = await read_frame(reader, self.timeout, max_payload=max_payload)
            if not reply.get("ok"):
                raise WireError("refused", str(reply.get("reason"))[:40])
            return reply, payload
        finally:
            await close_writer(writer)

    async def meta(self, donor: str, round: int, params_hash: str,
                   shapes: list[list[int]]) -> tuple[bytes, int, tuple[bytes, ...], tuple[str, ...]] | None:
        """What ``donor`` says of the snapshot it serves: (digest, chunk bytes, chunk digests, its
        shards' hashes) if it is (round, params_hash) of a model with these shapes, None if it
        serves another one; WireError ``bad_state_meta`` if its description does not fit that state."""
        size = _state_bytes(shapes)
        # At most one digest per smallest chunk a donor may use.
        bound = min(MAX_PAYLOAD_BYTES, DIGEST_BYTES * -(-size // MIN_STATE_CHUNK_BYTES))
        m, digests = await self._request(donor, {"op": "meta"}, max_payload=bound)
        if m.get("round") != round or m.get("hash") != params_hash:
            return None
        chunk = m.get("chunk")
        if (m.get("shapes") != shapes or m.get("size") != size or not isinstance(m.get("digest"), bytes)
                or not isinstance(chunk, int) or not MIN_STATE_CHUNK_BYTES <= chunk <= MAX_PAYLOAD_BYTES
                or len(digests) != DIGEST_BYTES * -(-size // chunk)):
            raise WireError("bad_state_meta", "does not describe this state")
        shards = m.get("shards", [])
        if not (isinstance(shards, list) and len(shards) <= MAX_SHARDS
                and all(isinstance(h, str) and 0 < len(h) <= 64 for h in shards)):
            raise WireError("bad_state_meta", "bad shard hashes")
        return (m["digest"], chunk, tuple(digests[i : i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES)),
                tuple(shards))

    async def fetch_chain(self, round: int, params_hash: str, donors: list[str], commits: CommitLog,
                          admits=lambda peer: True) -> list[CommitCertificate]:
        """The certificates that lead from a state ``commits`` trusts to (round, params_hash), from
        the first donor that has a valid chain; ``NoChain`` if none has.

        An honest donor holds the newest round's certificate only once the other members'
        signatures reached it, a moment after it announced the round: a chain that is whole
        but for that last certificate is asked for again, for up to ``CERT_WAIT_SECONDS`` in all."""
        reasons, liars = [], []
        wait_until = time.monotonic() + CERT_WAIT_SECONDS  # for all donors together
        for donor in donors:
            # Most of the time the chain from just below our own round is enough; else all of it.
            starts = sorted({max(0, min(round, max(commits.trusted)) - 16), 0}, reverse=True)
            chain: dict[int, CommitCertificate] = {}
            for after in starts:
                try:
                    why = await self._chain_from(donor, after, round, params_hash, chain, commits, admits,
                                                 wait_until)
                except ValueError as e:  # a signature that does not verify: no honest peer serves one
                    self.reject("bad_certificate", f"from {donor[-8:]}")
                    reasons.append(f"{donor[-8:]}: {e}")
                    liars.append(donor)
                    break
                except Exception as e:
                    reasons.append(f"{donor[-8:]}: {e!r}"[:80])
                    break
                if not why:
                    return sorted(chain.values(), key=lambda c: c.round)
                reasons.append(f"{donor[-8:]}: {why}")
        raise NoChain(f"no certificate chain to round {round} ({params_hash[:12]}): {'; '.join(reasons)}", liars)

    async def _chain_from(self, donor: str, after: int, round: int, params_hash: str,
                          chain: dict[int, CommitCertificate], commits: CommitLog, admits,
                          wait_until: float) -> str:
        """Ask ``donor`` for its certificates after ``after`` (into ``chain``) until they lead to
        (round, params_hash); "" once they do, else why not. Until ``wait_until``, a chain whole
        but for the newest certificate is asked for again."""
        while True:
            await self._certs_after(donor, after, round, chain)
            ok, why = verify_chain(list(chain.values()), commits.trusted, (round, params_hash),
                                   scope=commits.scope, admits=admits)
            if ok:
                return ""
            reaches_below = round - 1 in chain or round - 1 in commits.trusted
            if why != "no_certificate" or not reaches_below or time.monotonic() >= wait_until:
                return why
            after = round - 1  # all but the newest: its signatures are on their way
            await asyncio.sleep(CERT_POLL_SECONDS)

    async def _certs_after(self, donor: str, after: int, round: int, chain: dict[int, CommitCertificate]) -> None:
        """``donor``'s certificates of rounds after ``after`` up to ``round``, into ``chain``, a
        reply (``MAX_CERTS_PER_REPLY``) at a time; ValueError if one does not verify."""
        while True:
            _, payload = await self._request(donor, {"op": "certs", "after": after}, max_payload=MAX_PAYLOAD_BYTES)
            certs = decode_certs(payload)
            chain.update((c.round, c) for c in certs if c.round <= round)
            if not certs or certs[-1].round >= round:
                return
            after = certs[-1].round

    async def run(self, round: int, params_hash: str, donors: list[str], shapes: list[list[int]]) -> Snapshot:
        """Download and verify the snapshot (round, params_hash) of a model with these parameter
        shapes; raises RuntimeError on failure."""
        expected_size = _state_bytes(shapes)
        started = time.monotonic()
        metas = await asyncio.gather(*(self.meta(d, round, params_hash, shapes) for d in donors),
                                     return_exceptions=True)
        agreeing = {}
        for donor, meta in zip(donors, metas):
            if isinstance(meta, WireError) and meta.reason != "refused":  # as every handler counts them
                self.reject(meta.reason, f"from {donor[-8:]}: {meta}")
            elif isinstance(meta, BaseException):
                log.info("donor %s: %r", donor[-8:], meta)
            elif meta is not None:
                agreeing[donor] = meta
        if not agreeing:
            raise RuntimeError(f"no donor serves round {round} with params_hash {params_hash[:12]}")
        # Donors holding the same (round, params_hash) serve identical bytes; trust the common description.
        (digest, chunk, chunk_digests, shards), _ = Counter(agreeing.values()).most_common(1)[0]
        size = expected_size
        donors = [d for d, v in agreeing.items() if v == (digest, chunk, chunk_digests, shards)]
        blob = bytearray(size)
        queue: asyncio.Queue[int] = asyncio.Queue()
        offsets = list(range(0, size, chunk))
        for offset in offsets:
            queue.put_nowait(offset)
        remaining = {"chunks": len(offsets), "donors": len(donors)}
        failed: set[str] = set()
        done = asyncio.Event()

        async def pull(donor: str) -> None:
            while not done.is_set() and donor not in failed:
                try:
                    offset = queue.get_nowait()
                except asyncio.QueueEmpty:
                    await asyncio.sleep(0.05)  # chunks may come back from a failing donor
                    continue
                length = min(chunk, size - offset)
                header = {"op": "range", "round": round, "hash": params_hash, "offset": offset, "length": length}
                try:
                    _, payload = await self._request(donor, header, max_payload=chunk)
                    if len(payload) != length or _digest(payload) != chunk_digests[offset // chunk]:
                        self.reject("bad_state_chunk", f"from {donor[-8:]}")
                        raise WireError("bad_state_chunk")
                except Exception as e:
                    queue.put_nowait(offset)
                    if donor in failed:  # its other pulls stop too; counted once
                        return
                    failed.add(donor)
                    remaining["donors"] -= 1
                    log.info("donor %s failed (%r); %d donors left", donor[-8:], e, remaining["donors"])
                    if remaining["donors"] == 0:
                        done.set()
                    return
                blob[offset : offset + length] = payload
                self.metrics.received_bytes.inc(len(payload))
                remaining["chunks"] -= 1
                if remaining["chunks"] == 0:
                    done.set()

        pulls = max(1, min(PULLS_PER_DONOR, MAX_PULLS // len(donors)))
        # Round-robin: every donor's first pull starts before any donor's second, so a state of
        # few chunks is still spread over all donors.
        workers = [asyncio.create_task(pull(d)) for _ in range(pulls) for d in donors]
        try:
            await done.wait()
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if remaining["chunks"]:
            raise RuntimeError(f"all {len(donors)} donors failed before the state was complete")
        blob = await asyncio.to_thread(bytes, blob)  # the whole state: hashed and copied off the loop
        if await asyncio.to_thread(_digest, blob) != digest:
            raise RuntimeError("downloaded state does not match its digest")
        self.metrics.state_download_seconds.observe(time.monotonic() - started)
        log.info("downloaded round %d state (%.1f MB) from %d donors in %.2fs",
                 round, size / 1e6, len(donors), time.monotonic() - started)
        return Snapshot(round, params_hash, shapes, blob, digest, chunk, list(chunk_digests), shards)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def _chunk_digests(blob: bytes, chunk: int) -> list[bytes]:
    view = memoryview(blob)
    return [_digest(view[i : i + chunk]) for i in range(0, len(blob), chunk)]


def _state_bytes(shapes: list[list[int]]) -> int:
    """The blob's size: θ and the outer momentum of these shapes, fp32."""
    return 2 * 4 * sum(_numel(s) for s in shapes)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
