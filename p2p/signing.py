"""The members' signatures on a committed round: how a commit certificate (``commits.py``) is made.

After a round commits and this node applied it, it signs the certificate of
that round (``CommitSigning.certify``) and sends the signature to every other
member; their signatures come in on the round protocol's ``sign`` stream
(``receive``). A signature that arrives before this node finished applying
the round is kept and checked once it has; one that failed on the way, or
reached a member that did not know the group yet, is sent again a few times.
The certificate joins the node's chain (``CommitLog``) as soon as more than
half of the members signed; later signatures still add to it. Only members of
one of the last few committed groups may sign, and every signature is checked
against the member's key.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from p2p.commits import CommitCertificate, CommitLog
from p2p.ledger import Entry
from p2p.limits import BoundedDict

log = logging.getLogger(__name__)

SIGN_ATTEMPTS = 4  # deliveries of our signature to one member: at once, then after 0.25, 0.5, 1 s
SIGN_RETRY_SECONDS = 0.25


@dataclass(eq=False)
class _Signing:
    """The certificate of one committed group, while its members' signatures come in."""

    members: list[str]
    round: int
    cert: CommitCertificate | None = None
    early: list = field(default_factory=list)  # (member, public key, signature) before our own commit
    to: list[str] | None = None  # the members our signature goes to (None: all)
    entry: Entry | None = None  # the round's ledger entry, as this node built it at commit


class CommitSigning:
    """Certificates of this node's recent rounds; ``send(peer, header)`` delivers one signature."""

    def __init__(self, swarm, commits: CommitLog, send) -> None:
        self.swarm = swarm
        self.commits = commits
        self._send = send
        self._groups: BoundedDict = BoundedDict(8)  # group id -> _Signing
        self._last = b""
        self._tasks: set[asyncio.Task] = set()

    def committed(self, group_id: bytes, members: list[str], round: int, to: list[str] | None = None,
                  entry: Entry | None = None) -> None:
        """A group this node is a member of committed ``round`` (not applied yet), with the ledger
        ``entry`` the certificate covers. ``to``: the members to send our signature to, if not
        all (a member behind NAT reaches only the group's owners; a certificate holds with more
        than half of the signatures)."""
        if group_id not in self._groups:
            self._groups[group_id] = _Signing(list(members), round, to=None if to is None else list(to))
        elif to is not None:
            self._groups[group_id].to = list(to)
        self._groups[group_id].entry = entry
        self._last = group_id

    def certify(self, prev: str, new: str) -> asyncio.Task | None:
        """The last committed round is applied (``new`` its params_hash): sign its certificate and
        send the signature to the other members, in the background."""
        signing = self._groups.get(self._last)
        if signing is None or signing.cert is not None:
            return None
        signer = self.swarm.signer
        cert = CommitCertificate(self.swarm.scope, signing.round, prev, new, tuple(signing.members), signing.entry)
        signature = signer.sign(cert.message())
        cert.add(self.swarm.peer_id, signer.public_key, signature)
        for peer, public_key, theirs in signing.early:
            if not cert.add(peer, public_key, theirs):
                self.swarm.reject("bad_certificate", f"signature of {peer[-8:]}")
        signing.cert, signing.early = cert, []
        self._keep(cert)
        header = {"g": self._last, "pk": signer.public_key, "sig": signature}
        others = [p for p in (signing.to or signing.members) if p != self.swarm.peer_id]

        async def deliver(peer: str) -> bool:
            """Until the member takes it: a stream that failed, or a member that did not know the
            group yet, is tried again (a certificate missing one signature may never hold there)."""
            for attempt in range(SIGN_ATTEMPTS):
                if attempt:
                    await asyncio.sleep(SIGN_RETRY_SECONDS * 2 ** (attempt - 1))
                try:
                    reply, _ = await self._send(peer, header)
                except Exception:
                    continue
                if reply.get("ok") or reply.get("reason") != "unknown_group":
                    return bool(reply.get("ok"))
            return False

        async def send():
            results = await asyncio.gather(*(deliver(p) for p in others))
            missing = [p[-8:] for p, ok in zip(others, results) if not ok]
            if missing:
                log.info("round %d certificate: signature not taken by %s", cert.round, ", ".join(missing))

        task = asyncio.ensure_future(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def receive(self, sender: str, group_id: bytes, public_key: bytes, signature: bytes,
                current=None) -> str:
        """A member's signature; returns "" or why it was refused. ``current`` is the group this
        node is averaging now (a faster member may sign before this node has finished)."""
        signing = self._groups.get(group_id)
        if signing is None and current is not None and current.id == group_id:
            signing = self._groups[group_id] = _Signing(list(current.members), current.round + 1)
        if signing is None:
            return "unknown_group"
        if sender not in signing.members:
            return "not_a_member"
        if signing.cert is None:  # not applied here yet: checked once it is
            if len(signing.early) < len(signing.members):
                signing.early.append((sender, public_key, signature))
        elif signing.cert.add(sender, public_key, signature):
            self._keep(signing.cert)
        else:
            self.swarm.reject("bad_certificate", f"signature of {sender[-8:]}")
        return ""

    def _keep(self, cert: CommitCertificate) -> None:
        if cert.holds() and self.commits.certs.get(cert.round) is not cert:
            self.commits.add(cert)
