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

This module is the receiver's side (``StateDownload``); the donor's is
p2p/stateserver.py (``StateServer``), the blob and its digests p2p/snapshot.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from p2p.averagelog import RoundAverage, parse_table
from p2p.config import MIN_STATE_CHUNK_BYTES
from p2p.commits import CommitCertificate, CommitLog, decode_certs, verify_chain
from p2p.snapshot import DIGEST_BYTES, Snapshot, digest_of, state_bytes
from p2p.swarm import Swarm, peer_id_from
from p2p.wire import MAX_PAYLOAD_BYTES, WireError, close_writer, read_frame, write_frame

__all__ = ["NoChain", "StateDownload"]

log = logging.getLogger(__name__)

CERT_WAIT_SECONDS = 3.0  # how long a chain missing only its newest certificate is asked for again
CERT_POLL_SECONDS = 0.25
# Chunk requests in flight to one donor, and to all together. Each request is a new stream whose
# window starts small (256 KiB in yamux) and doubles each round trip, so one at a time carried a
# 4 MiB chunk in ~5 round trips: ~27 Mbit/s from one donor at 250 ms. Eight per donor keep up to
# 32 MiB in flight, a 1 Gbit/s link's bandwidth-delay product at 250 ms; the total bounds the
# receiver's buffers (32 chunks: 128 MiB at the default chunk size).
PULLS_PER_DONOR = 8
MAX_PULLS = 32
# A request for a round's average asks for a run of pieces this big: each request is a new
# stream whose window ramps from 256 KiB, so at 250 ms 4 MiB runs (7 requests for a 25 MB
# average) left the link half idle (51 Mbit/s of 100); at 1 MiB the same 32 requests in flight
# hold 32 MiB, a 1 Gbit/s link's bandwidth-delay product at 250 ms.
AVERAGE_BATCH_BYTES = 1 << 20
MAX_SHARDS = 1024  # ranks of one host (host.nproc_per_node's bound)


async def _no_hold() -> None:
    pass


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
        self.hold = _no_hold  # test hook (p2p/faults.py): awaited once the donors described the state
        # Where a download goes: scratch(numel) -> an fp32 vector (memory-mapped with
        # outer.state_dir, trainer/hoststate.py); None: a bytearray in RAM.
        self.scratch = None

    @classmethod
    def through(cls, p2p, reject, request_timeout: float, metrics, name: str) -> "StateDownload":
        """A download on a handle other than the swarm's (a multi-rank host's other ranks)."""
        self = cls.__new__(cls)
        self.p2p, self.reject, self.timeout = p2p, reject, request_timeout
        self.metrics, self.name, self.hold, self.scratch = metrics, name, _no_hold, None
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
        size = state_bytes(shapes)
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

    async def _agreeing(self, donors: list[str], describe) -> tuple[object, list[str]]:
        """Every donor's description (``describe(donor)``: None if it holds something else), and
        the one most of them give with the donors that give it; (None, []) if none does. What a
        donor sends malformed is counted as every handler counts it."""
        answers = await asyncio.gather(*(describe(d) for d in donors), return_exceptions=True)
        agreeing = {}
        for donor, answer in zip(donors, answers):
            if isinstance(answer, WireError) and answer.reason != "refused":
                self.reject(answer.reason, f"from {donor[-8:]}: {answer}")
            elif isinstance(answer, BaseException):
                log.info("donor %s: %r", donor[-8:], answer)
            elif answer is not None:
                agreeing[donor] = answer
        if not agreeing:
            return None, []
        # Donors holding the same state serve identical bytes: trust the common description.
        common, _ = Counter(agreeing.values()).most_common(1)[0]
        return common, [d for d, v in agreeing.items() if v == common]

    async def _pull(self, donors: list[str], jobs: list[tuple[dict, int]], check, store, bad: str) -> None:
        """Ask ``donors`` for every job (a request header and the payload's length) in parallel,
        each payload checked (``check(i, payload)``, else rejected as ``bad``) and stored
        (``store(i, payload)``); a failing donor's jobs go to the others. RuntimeError if every
        donor failed before all were done."""
        if not jobs:
            return
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(jobs)):
            queue.put_nowait(i)
        remaining = {"jobs": len(jobs), "donors": len(donors)}
        failed: set[str] = set()
        done = asyncio.Event()

        async def pull(donor: str) -> None:
            while not done.is_set() and donor not in failed:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    await asyncio.sleep(0.05)  # jobs may come back from a failing donor
                    continue
                header, length = jobs[i]
                try:
                    _, payload = await self._request(donor, header, max_payload=length)
                    # Hashing (and a codec's check) off the event loop: a 4 MiB chunk is milliseconds.
                    if len(payload) != length or not await asyncio.to_thread(check, i, payload):
                        self.reject(bad, f"from {donor[-8:]}")
                        raise WireError(bad)
                except Exception as e:
                    queue.put_nowait(i)
                    if donor in failed:  # its other pulls stop too; counted once
                        return
                    failed.add(donor)
                    remaining["donors"] -= 1
                    log.info("donor %s failed (%r); %d donors left", donor[-8:], e, remaining["donors"])
                    if remaining["donors"] == 0:
                        done.set()
                    return
                store(i, payload)
                self.metrics.received_bytes.inc(len(payload))
                remaining["jobs"] -= 1
                if remaining["jobs"] == 0:
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
        if remaining["jobs"]:
            raise RuntimeError(f"all {len(donors)} donors failed before the download was complete")

    async def average(self, round: int, prev: str, new: str, donors: list[str], numel: int,
                      codec) -> RoundAverage:
        """The average of committed round ``round`` (prev -> new) as the donors kept it
        (p2p/averagelog.py), every piece checked against the piece digests most donors
        agree on and by ``codec``; RuntimeError if no donor holds it. Whether its outer step
        gives ``new`` is the caller's to check."""
        async def meta(donor: str):
            m, payload = await self._request(donor, {"op": "avg_meta", "round": round},
                                             max_payload=MAX_PAYLOAD_BYTES)
            if (m.get("round"), m.get("prev"), m.get("new"), m.get("codec")) != (round, prev, new, codec.name):
                return None
            try:
                table, digests = parse_table(payload, numel, codec)
            except ValueError as e:
                raise WireError("bad_average_meta", str(e)) from None
            return tuple(table), tuple(digests)

        common, donors = await self._agreeing(donors, meta)
        if common is None:
            raise RuntimeError(f"no donor holds the average of round {round}")
        table, digests = common
        # Runs of consecutive pieces, up to AVERAGE_BATCH_BYTES each, one request each.
        jobs, batches, first, size = [], [], 0, 0
        limit = AVERAGE_BATCH_BYTES
        for k, (_, _, n) in enumerate(table):
            if k > first and size + n > limit:
                batches.append((first, k))
                first, size = k, 0
            size += n
        batches.append((first, len(table)))
        for a, b in batches:
            jobs.append(({"op": "avg_range", "round": round, "first": a, "count": b - a},
                         sum(n for _, _, n in table[a:b])))
        payloads: list[bytes | None] = [None] * len(table)

        def check(i: int, payload: bytes) -> bool:
            a, b = batches[i]
            view, at = memoryview(payload), 0
            for k in range(a, b):
                start, end, n = table[k]
                piece = view[at : at + n]
                at += n
                if digest_of(piece) != digests[k]:
                    return False
                try:
                    codec.check(piece, end - start)
                except ValueError:
                    return False
            return True

        def store(i: int, payload: bytes) -> None:
            a, b = batches[i]
            at = 0
            for k in range(a, b):
                n = table[k][2]
                payloads[k] = payload[at : at + n]
                at += n

        started = time.monotonic()
        await self._pull(donors, jobs, check, store, "bad_average")
        log.info("downloaded round %d average (%.1f MB, %s) from %d donors in %.2fs", round,
                 sum(n for _, _, n in table) / 1e6, codec.name, len(donors), time.monotonic() - started)
        return RoundAverage(round, prev, new, codec.name, [(s, e) for s, e, _ in table], payloads)

    async def run(self, round: int, params_hash: str, donors: list[str], shapes: list[list[int]]) -> Snapshot:
        """Download and verify the snapshot (round, params_hash) of a model with these parameter
        shapes; raises RuntimeError on failure."""
        expected_size = state_bytes(shapes)
        started = time.monotonic()
        common, donors = await self._agreeing(donors, lambda d: self.meta(d, round, params_hash, shapes))
        if common is None:
            raise RuntimeError(f"no donor serves round {round} with params_hash {params_hash[:12]}")
        digest, chunk, chunk_digests, shards = common
        size = expected_size
        await self.hold()
        # Written in place, chunk by chunk, and never copied after: it is the snapshot's blob.
        blob = bytearray(size) if self.scratch is None else memoryview(self.scratch(size // 4).numpy()).cast("B")
        jobs = []
        for offset in range(0, size, chunk):
            length = min(chunk, size - offset)
            jobs.append(({"op": "range", "round": round, "hash": params_hash, "offset": offset, "length": length},
                         length))

        def check(i: int, payload: bytes) -> bool:
            return digest_of(payload) == chunk_digests[i]

        def store(i: int, payload: bytes) -> None:
            blob[i * chunk : i * chunk + len(payload)] = payload

        await self._pull(donors, jobs, check, store, "bad_state_chunk")
        if await asyncio.to_thread(digest_of, blob) != digest:  # the whole state: hashed off the loop
            raise RuntimeError("downloaded state does not match its digest")
        self.metrics.state_download_seconds.observe(time.monotonic() - started)
        log.info("downloaded round %d state (%.1f MB) from %d donors in %.2fs",
                 round, size / 1e6, len(donors), time.monotonic() - started)
        return Snapshot(round, params_hash, shapes, blob, digest, chunk, list(chunk_digests), shards)
