"""Who may take part in a closed swarm, enforced where peers reach this node.

``Membership`` (p2p/membership.py) decides, purely, whether a peer id is
admitted from what this node knows: the allow-list and the membership
certificates it has seen. This module carries that decision out on the
network: every request handler asks ``admits`` first; a caller with no
certificate known yet is asked for one over ``gonka.<run>.member`` (bounded
in time, number and retries); hivemind's DHT routing table never keeps a
peer that is not admitted. In an open swarm everyone is admitted and none of
this costs anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable

from hivemind.p2p import P2P, PeerID

from p2p.limits import BoundedDict
from p2p.membership import Membership
from p2p.wire import close_writer, linger, read_frame, write_frame

log = logging.getLogger(__name__)

CERT_FETCH_SECONDS = 5.0  # at most, for one look-up
CERT_RETRY_SECONDS = 5.0  # a peer that had no good certificate is not asked again before this
MAX_CERT_FETCHES = 64  # look-ups in flight at once
_MAX_TRACKED = 4096  # peers remembered as having no good certificate


class Admission:
    """The closed swarm's gate on one node's p2p host; see the module docstring."""

    def __init__(self, membership: Membership, p2p: P2P, run_id: str, reject: Callable[[str, str], None],
                 request_timeout: float) -> None:
        self.membership = membership
        self.p2p = p2p
        self.name = f"gonka.{run_id}.member"
        self._reject = reject
        self._timeout = min(CERT_FETCH_SECONDS, request_timeout)
        self._fetches: dict[str, asyncio.Task] = {}
        self._no_cert = BoundedDict(_MAX_TRACKED)  # peer -> when a look-up found no good certificate

    async def start(self) -> None:
        """Serve this node's certificate. Before the DHT starts: a member we bootstrap through
        asks for it first."""
        await self.p2p.add_binary_stream_handler(self.name, self._serve_cert)

    def close(self) -> None:
        """Cancel the certificate look-ups in flight."""
        for task in list(self._fetches.values()):
            task.cancel()

    async def admits(self, peer_id: str, *, count: bool = True) -> bool:
        """Whether ``peer_id`` may take part in this run: the check every handler of a peer's
        request makes first (with the authenticated remote peer id). Always True in an open
        swarm. In a closed one with an authority, a caller whose certificate this node has
        not seen yet is asked for it (one look-up at a time per peer, bounded in time; a
        failed one is not retried for a few seconds). A refusal is counted as
        ``not_admitted`` unless ``count`` is False."""
        membership = self.membership
        if not membership.closed:
            return True
        admitted, why = membership.admits(peer_id, time.time())
        if not admitted and membership.authority is not None:
            await self._fetch_cert(peer_id)
            admitted, why = membership.admits(peer_id, time.time())
        if not admitted and count:
            self._reject("not_admitted", f"{peer_id}: {why}")
        return admitted

    def admitted(self, peer_id: str) -> bool:
        """``admits`` without a look-up and uncounted: what this node knows now."""
        return self.membership.admits(peer_id, time.time())[0]

    async def gate_routing_table(self, protocol) -> None:
        """Never keep a peer that is not admitted in the DHT routing table (the peers this node
        tells others about, and stores records on). hivemind updates the table on every
        request in and out through ``protocol.update_routing_table``; this wraps it."""
        table = protocol.routing_table
        update = protocol.update_routing_table

        async def update_routing_table(node_id, peer_id: PeerID, responded: bool = True):
            if responded and not await self.admits(peer_id.to_base58(), count=False):
                node_id = node_id if node_id is not None else table.get(peer_id=peer_id)
                if node_id is not None and node_id in table:
                    del table[node_id]
                return
            await update(node_id, peer_id, responded=responded)

        protocol.update_routing_table = update_routing_table
        # Whatever the bootstrap added before the wrapper was in place.
        entries = list(table.uid_to_peer_id.items())
        verdicts = await asyncio.gather(*(self.admits(p.to_base58(), count=False) for _, p in entries))
        for (node_id, _), admitted in zip(entries, verdicts):
            if not admitted and node_id in table:
                del table[node_id]

    async def _fetch_cert(self, peer_id: str) -> None:
        failed_at = self._no_cert.get(peer_id)
        if failed_at is not None and time.monotonic() - failed_at < CERT_RETRY_SECONDS:
            return
        task = self._fetches.get(peer_id)
        if task is None:
            if len(self._fetches) >= MAX_CERT_FETCHES:
                return
            task = self._fetches[peer_id] = asyncio.create_task(self._ask_cert(peer_id), name="member-cert")
            task.add_done_callback(lambda _: self._fetches.pop(peer_id, None))
        with contextlib.suppress(Exception):
            await asyncio.shield(task)  # a caller that gives up does not cancel the others' look-up

    async def _ask_cert(self, peer_id: str) -> None:
        why = ""
        try:
            async with asyncio.timeout(self._timeout):
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), self.name)
                try:
                    header, _ = await read_frame(reader, self._timeout, max_payload=0)
                finally:
                    await close_writer(writer)
            cert = header.get("cert")
            why = self.membership.learn_cert(cert, time.time()) if isinstance(cert, bytes) and cert else "none"
        except Exception as e:  # unreachable, timed out, garbage: no certificate
            why = f"no answer ({type(e).__name__})"
        if why:
            log.debug("no membership certificate from %s: %s", peer_id, why)
            self._no_cert[peer_id] = time.monotonic()

    async def _serve_cert(self, info, reader, writer) -> None:
        """``gonka.<run>.member``: answer with this node's certificate (empty without one)."""
        try:
            await write_frame(writer, {"cert": self.membership.own_cert})
            await linger(reader, self._timeout)
        except Exception:  # a requester that went away is no error
            pass
        finally:
            await close_writer(writer)
