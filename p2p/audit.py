"""Catching a part owner that lies about its slice, in the round it lies.

In the butterfly all-reduce each member owns one part and sends every other
member the average of that part. An owner could send a finite but altered
average and nobody would notice: the vote only checks that every member got
the same bytes. So before it votes, every member audits one randomly chosen
piece of the previous member's part (``OwnerAudit.target``, p2p/owneraudit.py): it asks every
member for its input to that piece, recomputes the piece as the owner must
have (``OwnerAudit.recompute``: each input against the hash declared for it, which is
part of the vote) and compares. On a mismatch the attempt fails before
anything is applied; if the owner is the one shown lying, the auditor sends
the inputs to every member as evidence, and each checks it alone: it
quarantines the owner if the evidence holds, the accuser if it does not.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from p2p.exchange import off_loop
from p2p.failure import RoundFailed
from p2p.group import Group
from p2p.limits import BoundedDict
from p2p.wire import WireError, field as hfield, read_frame, reply, write_frame

# An input bigger than this is fetched in ranges of it, all at once: each request is a new
# stream, whose window starts at 256 KiB and doubles each round trip, so a 1 MiB fp32 piece
# in one reply took ~3 round trips of data; in four it takes one (docs/wan.md).
AUDIT_SPAN = 256 * 1024


class PartAudit:
    """Audits for one node's rounds: the auditor's side (``check``) and the two requests it
    sends (``on_audit``: an input to a piece; ``on_evidence``: what an auditor found)."""

    def __init__(self, codec, metrics, call: Callable[..., Awaitable], send: Callable[..., Awaitable],
                 reject: Callable[[str, str], None], offence: Callable[[str, str], None],
                 request_timeout: float) -> None:
        self.codec = codec
        self.metrics = metrics
        self._call = call  # (peer, request name, header, max_payload=) -> (reply header, payload)
        self._send = send  # (peer, request name, header, payload)
        self._reject = reject
        self._offence = offence
        self.request_timeout = request_timeout
        # Our input to a piece, once per (group, part, piece): an auditor asks for it in ranges,
        # and a failed check of the owner's declaration must count once, not once a range.
        self._inputs: BoundedDict = BoundedDict(64)

    async def check_when_placed(self, group: Group, others: list[str], deadline: float) -> None:
        """``check``, as soon as the part it samples is in: while the other parts still arrive."""
        owner = group.audit.owner()
        for k in range(len(group.pieces[owner]) if owner is not None else 0):
            await group.placed(owner, k, deadline)
        await self.check(group, others)

    async def check(self, group: Group, others: list[str]) -> None:
        """Recompute this member's sampled piece from every member's input; raise RoundFailed
        (and blame whom it shows lying) unless it matches what the owner sent."""
        target = group.audit.target()
        if target is None:
            return
        index, k = target
        start, end = group.pieces[index][k]
        expected = self.codec.wire_bytes(end - start)

        async def fetch_range(i: int, offset: int, size: int) -> bytes:
            request = {"g": group.id, "j": index, "k": k}
            if size < expected:
                request.update(o=offset, n=size)
            header, payload = await self._call(group.members[i], "audit", request, max_payload=size)
            if header.get("ok") is False:  # it failed the round (the owner lied about its input): no blame
                raise RoundFailed("peer_failed", str(header.get("reason"))[:40])
            if len(payload) != size:
                group.blame.setdefault(group.members[i], "audit_failed")
                raise RoundFailed("audit_failed", f"{group.members[i][-8:]} sent no input")
            return payload

        async def fetch(i: int) -> bytes:
            if i == group.index:
                return await self.own_input(group, index, k)
            ranges = [(o, min(AUDIT_SPAN, expected - o)) for o in range(0, expected, AUDIT_SPAN)]
            return b"".join(await asyncio.gather(*(fetch_range(i, o, n) for o, n in ranges)))

        payloads = await asyncio.gather(*(fetch(i) for i in range(len(group.members))))
        culprit = await off_loop(group.audit.recompute, index, k, payloads)
        if culprit is None:
            return
        peer = group.members[int(culprit)]
        group.blame.setdefault(peer, "audit_failed")
        # Failed here first: the aborts the evidence sets off answer ours, they start nothing.
        group.fail("audit_failed", peer[-8:])
        self._reject("audit_failed", f"piece {k} of {group.members[index][-8:]}'s part, by {peer[-8:]}")
        if int(culprit) == index:  # the owner: every member can check the evidence itself
            header = {"g": group.id, "j": index, "k": k, "d": group.audit.declared[index][k]}
            evidence = b"".join(payloads)
            await asyncio.gather(*(self._send(p, "evidence", header, evidence) for p in others),
                                 return_exceptions=True)
        raise RoundFailed("audit_failed", f"{peer[-8:]}")

    def _piece(self, group: Group, header: dict) -> tuple[int, int]:
        j, k = hfield(header, "j", int), hfield(header, "k", int)
        if not (0 <= j < len(group.members) and 0 <= k < len(group.pieces[j])):
            raise WireError("bad_field", "audit piece")
        return j, k

    async def own_input(self, group: Group, j: int, k: int) -> bytes:
        """Our input to piece ``k`` of part ``j`` (re-encoded: the same bytes), once the owner's
        declaration of it is here and records it. If it does not, the owner lied about our
        input: the round fails here (the owner blamed) before the audit could blame us."""
        key = (group.id, j, k)
        found = self._inputs.get(key)
        if found is None:
            found = self._inputs[key] = asyncio.ensure_future(self._own_input(group, j, k))
        return await asyncio.shield(found)

    async def _own_input(self, group: Group, j: int, k: int) -> bytes:
        await group.placed(j, k, asyncio.get_running_loop().time() + self.request_timeout)
        payload = await off_loop(group.contribution, j, k)
        try:
            await off_loop(group.audit.check_own_input, j, k, payload)
        except RoundFailed as e:
            self._reject(e.reason, str(e))
            group.blame.setdefault(group.members[j], e.reason)
            group.fail(e.reason, str(e))
            raise
        return payload

    async def on_audit(self, group: Group, header: dict, writer) -> None:
        """An auditor asks for our input to one piece of one part, or (``o``, ``n``) for ``n`` of
        its bytes from offset ``o`` (``AUDIT_SPAN``)."""
        j, k = self._piece(group, header)
        start, end = group.pieces[j][k]
        size = self.codec.wire_bytes(end - start)
        offset, length = 0, size
        if "o" in header or "n" in header:
            offset, length = hfield(header, "o", int), hfield(header, "n", int)
            if not (0 <= offset < size and 0 < length <= size - offset):
                raise WireError("bad_field", "audit range")
        try:
            payload = await self.own_input(group, j, k)
        except RoundFailed as e:
            await reply(writer, {"ok": False, "reason": e.reason})
            return
        self.metrics.sent_bytes.inc(await write_frame(writer, {"ok": True}, payload[offset:offset + length]))

    async def on_evidence(self, group: Group, sender: str, header: dict, reader, writer) -> None:
        """An auditor's evidence that the owner of a part lied: every member's input to the piece.
        Checked here like the auditor checked it (the inputs must match the declaration all
        members voted on); whoever the evidence shows lying is quarantined — the owner, or the
        accuser if the evidence does not hold."""
        j, k = self._piece(group, header)
        declared = hfield(header, "d", bytes)
        await group.placed(j, k, asyncio.get_running_loop().time() + self.request_timeout, failed_too=True)
        if declared != group.audit.declared[j][k]:  # the owner told us otherwise, or the accuser lies: no blame
            group.fail("digest_mismatch", f"declarations of piece {k} of {group.members[j][-8:]}'s part differ")
            await reply(writer, {"ok": True})
            return
        start, end = group.pieces[j][k]
        size = self.codec.wire_bytes(end - start)
        _, payload = await read_frame(reader, self.request_timeout, max_payload=size * len(group.members))
        if len(payload) != size * len(group.members):
            raise WireError("bad_size", "evidence")
        payloads = [payload[i * size:(i + 1) * size] for i in range(len(group.members))]
        culprit = await off_loop(group.audit.recompute, j, k, payloads)
        owner = group.members[j]
        if culprit is not None and int(culprit) == j:
            self._reject("audit_failed", f"piece {k} of {owner[-8:]}'s part, shown by {sender[-8:]}")
            group.blame.setdefault(owner, "audit_failed")
            self._offence(owner, "audit_failed")
            group.fail("audit_failed", f"{owner[-8:]}, shown by {sender[-8:]}")  # not the auditor's fault
        else:  # the evidence does not show what it claims: the accuser lied
            self._reject("bad_evidence", sender[-8:])
            self._offence(sender, "bad_evidence")
        await reply(writer, {"ok": True})
