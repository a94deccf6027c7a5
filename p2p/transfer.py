"""State transfer: how a joining or diverged peer gets the swarm's global state.

The state is one blob: the global parameters then the outer momentum, fp32,
in model order, plus the round number. Every donor serves the snapshot of its
last committed round: ``meta`` (round, params_hash, size, digest, shapes) and
byte ranges of the blob. A receiver picks the (round, params_hash) most live
peers agree on, downloads chunks from all donors holding it in parallel,
hands a dead donor's chunks to the others, and verifies the blob digest
before anyone loads it (the caller then checks ``params_hash`` too).

Serving is cheap for the donor: the snapshot is built once per round, and
requests only slice it, so a joiner never stalls the donor's own averaging.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from p2p import faults
from p2p.swarm import PeerRecord, Swarm, peer_id_from
from p2p.wire import MAX_PAYLOAD_BYTES, WireError, close_writer, field as hfield, linger, read_frame, write_frame

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Snapshot:
    """An immutable copy of the global state at one committed round."""

    round: int
    params_hash: str
    shapes: list[list[int]]
    blob: bytes
    digest: bytes
    # The blob is served in pieces of chunk_bytes; the digest of every piece lets a
    # receiver check each one as it arrives.
    chunk_bytes: int
    chunk_digests: list[bytes]

    @classmethod
    def build(cls, round: int, params_hash: str, params: list[torch.Tensor], momentum: list[torch.Tensor],
              chunk_bytes: int) -> "Snapshot":
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in [*params, *momentum]])
        blob = flat.numpy().tobytes()
        return cls(round, params_hash, [list(p.shape) for p in params], blob, _digest(blob), chunk_bytes,
                   _chunk_digests(blob, chunk_bytes))

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


def pick_target(peers: dict[str, PeerRecord], mine: tuple[int, str] | None = None
                ) -> tuple[int, str, list[str]] | None:
    """The swarm's state: the (round, params_hash) held by most peers at the newest round
    (``mine`` votes too; ties go to the smaller hash, so every peer picks the same), and
    the other peers that hold it. None if nobody holds any state yet."""
    holders = [(r.round, r.params_hash, r.peer_id) for r in peers.values() if r.state != "joining" and r.params_hash]
    votes = Counter((rnd, h) for rnd, h, _ in holders)
    if mine is not None:
        votes[mine] += 1
    if not votes:
        return None
    newest = max(rnd for rnd, _ in votes)
    _, params_hash = min((-n, h) for (rnd, h), n in votes.items() if rnd == newest)
    return newest, params_hash, sorted(p for rnd, h, p in holders if (rnd, h) == (newest, params_hash))


class StateServer:
    """Serves the latest snapshot to peers that ask for it."""

    def __init__(self, swarm: Swarm, metrics) -> None:
        self.swarm = swarm
        self.metrics = metrics
        self.snapshot: Snapshot | None = None
        self.name = f"gonka.{swarm.scope}.state"

    async def start(self) -> None:
        await self.swarm.p2p.add_binary_stream_handler(self.name, self._handle)

    async def _handle(self, info, reader, writer) -> None:
        try:
            header, _ = await read_frame(reader, self.swarm.config.request_timeout)
            snap = self.snapshot
            op = hfield(header, "op", str)
            requester = info.peer_id.to_base58()
            # Only peers that announced themselves in this run's peer table get the state.
            if requester not in self.swarm.peers and requester not in await self.swarm.refresh_peers():
                self.swarm.reject("not_in_swarm", requester[-8:])
                await write_frame(writer, {"ok": False, "reason": "not_in_swarm"})
            elif snap is None:
                await write_frame(writer, {"ok": False, "reason": "no_state"})
            elif op == "meta":
                await write_frame(writer, {"ok": True, "round": snap.round, "hash": snap.params_hash,
                                           "size": len(snap.blob), "digest": snap.digest, "shapes": snap.shapes,
                                           "chunk": snap.chunk_bytes, "chunks": snap.chunk_digests})
            elif op == "range":
                offset, length = hfield(header, "offset", int), hfield(header, "length", int)
                if hfield(header, "round", int) != snap.round or hfield(header, "hash", str) != snap.params_hash:
                    await write_frame(writer, {"ok": False, "reason": "moved_on"})
                    return
                if not (0 <= offset and 0 < length <= snap.chunk_bytes and offset + length <= len(snap.blob)):
                    raise WireError("bad_range")
                faults.checkpoint("serve", snap.round + 1)
                sent = await write_frame(writer, {"ok": True}, memoryview(snap.blob)[offset : offset + length])
                self.metrics.sent_bytes.inc(sent)
                self.metrics.state_served.inc()
                await linger(reader, self.swarm.config.request_timeout)
            else:
                raise WireError("bad_op")
        except WireError as e:
            self.swarm.reject(e.reason, str(e))
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # the requester went away, or we are shutting down
        except Exception as e:
            log.exception("state handler failed")
            self.swarm.reject("handler_error", repr(e))
        finally:
            await close_writer(writer)


class StateDownload:
    """Fetch one snapshot from several donors in parallel; see the module docstring."""

    def __init__(self, swarm: Swarm, metrics, name: str) -> None:
        self.swarm = swarm
        self.metrics = metrics
        self.name = name
        self.timeout = swarm.config.request_timeout

    async def _request(self, donor: str, header: dict, max_payload: int = 0) -> tuple[dict, bytes]:
        async with asyncio.timeout(self.timeout):
            _, reader, writer = await self.swarm.p2p.call_binary_stream_handler(peer_id_from(donor), self.name)
        try:
            await write_frame(writer, header)
            reply, payload = await read_frame(reader, self.timeout, max_payload=max_payload)
            if not reply.get("ok"):
                raise WireError("refused", str(reply.get("reason"))[:40])
            return reply, payload
        finally:
            await close_writer(writer)

    async def run(self, round: int, params_hash: str, donors: list[str], shapes: list[list[int]]) -> Snapshot:
        """Download and verify the snapshot (round, params_hash) of a model with these parameter
        shapes; raises RuntimeError on failure."""
        expected_size = 2 * 4 * sum(_numel(s) for s in shapes)
        started = time.monotonic()
        metas = await asyncio.gather(*(self._request(d, {"op": "meta"}) for d in donors), return_exceptions=True)
        agreeing = {}
        for donor, meta in zip(donors, metas):
            if isinstance(meta, BaseException):
                log.info("donor %s: %r", donor[-8:], meta)
                continue
            m = meta[0]
            if m.get("round") == round and m.get("hash") == params_hash:
                chunks, chunk = m.get("chunks"), m.get("chunk")
                if (m.get("shapes") != shapes or m.get("size") != expected_size or not isinstance(m.get("digest"), bytes)
                        or not isinstance(chunk, int) or not 0 < chunk <= MAX_PAYLOAD_BYTES
                        or not isinstance(chunks, list) or len(chunks) != -(-expected_size // chunk)
                        or not all(isinstance(c, bytes) for c in chunks)):
                    self.swarm.reject("bad_state_meta", f"from {donor[-8:]}")
                    continue
                agreeing[donor] = (m["digest"], chunk, tuple(chunks))
        if not agreeing:
            raise RuntimeError(f"no donor serves round {round} with params_hash {params_hash[:12]}")
        # Donors holding the same (round, params_hash) serve identical bytes; trust the common description.
        (digest, chunk, chunk_digests), _ = Counter(agreeing.values()).most_common(1)[0]
        size = expected_size
        donors = [d for d, v in agreeing.items() if v == (digest, chunk, chunk_digests)]
        blob = bytearray(size)
        queue: asyncio.Queue[int] = asyncio.Queue()
        offsets = list(range(0, size, chunk))
        for offset in offsets:
            queue.put_nowait(offset)
        remaining = {"chunks": len(offsets), "donors": len(donors)}
        done = asyncio.Event()

        async def pull(donor: str) -> None:
            while not done.is_set():
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
                        self.swarm.reject("bad_state_chunk", f"from {donor[-8:]}")
                        raise WireError("bad_state_chunk")
                except Exception as e:
                    queue.put_nowait(offset)
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

        workers = [asyncio.create_task(pull(d)) for d in donors]
        try:
            await done.wait()
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if remaining["chunks"]:
            raise RuntimeError(f"all {len(donors)} donors failed before the state was complete")
        if _digest(bytes(blob)) != digest:
            raise RuntimeError("downloaded state does not match its digest")
        self.metrics.state_download_seconds.observe(time.monotonic() - started)
        log.info("downloaded round %d state (%.1f MB) from %d donors in %.2fs",
                 round, size / 1e6, len(donors), time.monotonic() - started)
        return Snapshot(round, params_hash, shapes, bytes(blob), digest, chunk, list(chunk_digests))


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _chunk_digests(blob: bytes, chunk: int) -> list[bytes]:
    view = memoryview(blob)
    return [_digest(view[i : i + chunk]) for i in range(0, len(blob), chunk)]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
