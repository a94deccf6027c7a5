"""The vote that ends a group's all-reduce, and the word that an attempt is off.

Once its shards are reduced and audited, a member votes on the digest of the whole
averaged vector (``Group.digest``; a multi-rank host on the digest of its shards'). Votes
go to the owners at once; a member that owns no part hears an owner's vote only once
that owner holds every vote and all are equal, so its vote says the whole group agreed
and members that may sit behind NAT never have to meet (``Group.voters``). A round
commits on a member when every vote it waits for is in and equal to its own.

An attempt that fails anywhere is called off everywhere: the member that failed tells
the others why and on whom (``abort``), and each passes it on. ``RoundProtocol`` owns one
``VoteExchange`` and hands it the requests it sends (``call``) and its background tasks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from p2p.exchange import all_or_fail
from p2p.failure import RoundFailed
from p2p.group import Group
from p2p.wire import WireError, field as hfield

log = logging.getLogger("p2p.rounds")

# A member our vote did not reach may still have voted: votes cross, so its own may arrive
# this long after our send to it failed (see VoteExchange._to_all).
VOTE_GRACE_SECONDS = 2.0
VOTE_GRACE_TRIPS = 8  # or this many of the group's round trips, if longer


class VoteExchange:
    """Our votes and aborts out, the others' in; see the module docstring."""

    def __init__(self, call: Callable[..., Awaitable], background: Callable[[Awaitable], None]) -> None:
        """``call(peer, "vote", header, timeout=None)``: a request to a member, its answer.
        ``background(call)``: run a best-effort request without waiting for it."""
        self._call = call
        self._background = background

    async def vote(self, group: Group, digest: bytes, deadline: float) -> None:
        """Vote ``digest`` and return once the group agreed on it; RoundFailed if it did not
        (``digest_mismatch``), or a member we wait for failed or fell silent by ``deadline``."""
        group.add_vote(group.index, digest)
        header = {"g": group.id, "digest": digest}
        owners = [group.members[i] for i in group.owner_indices() if i != group.index]
        agreed = asyncio.ensure_future(group.agreed(deadline))
        await self._to_all(group, owners, header, agreed)
        group.mark("voted")
        if not agreed.result():
            raise RoundFailed("digest_mismatch")
        if group.owns[group.index]:
            for peer in group.members:
                if peer != group.me and peer not in owners:
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

    async def abort(self, group: Group, reason: str, culprit: int | None = None) -> None:
        """Every other member hears that the attempt is off, why, and whom we failed on (if anyone:
        ``Group.culprit``): an abort that names nobody else is ours to answer for (p2p/quarantine.py)."""
        others = [group.members[i] for i in group.voters() if i != group.index]
        if culprit is None:
            culprit = group.culprit(reason)
        header = {"g": group.id, "abort": reason[:40], **({"c": culprit} if culprit is not None else {})}
        await asyncio.gather(*(self._call(p, "vote", header, timeout=2.0) for p in others), return_exceptions=True)

    @staticmethod
    def received(group: Group, sender: str, index: int, header: dict) -> None:
        """A member's vote or abort (``header``) for ``group``, from ``sender`` at ``index``."""
        if "abort" in header:
            group.aborted_by(sender, str(header["abort"])[:40], header.get("c"))
        else:
            group.add_vote(index, hfield(header, "digest", bytes))
