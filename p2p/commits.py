"""Commit certificates: which state a peer may follow, as signed by the rounds that made it.

After a round commits, every member signs (run scope, round, previous
``params_hash``, new ``params_hash``, members) with its libp2p key and sends
the signature to the others; a certificate holds the signatures a member
collected. A certificate *holds* when more than half of its members signed
it (each signature checked against the member's own public key, whose hash is
its peer id) and, in a closed swarm, every counted signer is admitted.

A node adopts a state it did not compute only through a chain of holding
certificates that starts at a state it already trusts — one it computed
itself (its history), or the run's genesis, which it computes from the
fingerprint like every peer — and ends at the state offered. The node keeps
its own chain (``CommitLog``), serves it to joiners, and stores it in its
checkpoints. Pure functions and small classes: no network here.

What this does not stop: in an open swarm, a party that runs more than half
of the identities of every round it forges (sybils) can forge a chain; the
follow rule (``quorum.follow``) also asks a majority of the live peers to
announce the state. A closed swarm bounds identities to admitted ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import msgpack

from p2p.ledger import STANDING_ROUNDS, Entry, Standing
from p2p.records import peer_id_of_public_key, verify_rsa

MAX_MEMBERS = 1024
MAX_KEY_BYTES = 1024  # a serialized RSA-4096 public key is ~550 bytes
MAX_SIGNATURE_BYTES = 1024
MAX_CERTS_PER_REPLY = 4096
KEPT_ENTRIES = 4 * STANDING_ROUNDS  # ledger entries kept apart from certificates (``CommitLog.record``)
_HASH_CHARS = 128


@dataclass(slots=True)
class CommitCertificate:
    """The members' signatures on one committed round."""

    scope: str
    round: int  # the round this commit produced (the worker's round after it)
    prev: str  # params_hash before the round
    new: str  # params_hash after it
    members: tuple[str, ...]
    entry: Entry | None = None  # the round's ledger entry (p2p/ledger.py); None in certificates before it
    signatures: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # member -> (public key, signature)
    _valid: set[str] = field(default_factory=set)  # members whose signature was checked and holds

    def __post_init__(self) -> None:
        assert self.entry is None or (self.entry.round == self.round and self.entry.members == self.members)

    def message(self) -> bytes:
        """What every member signs: the round, its states, its members and its ledger entry's digest."""
        signed = ["gonka-commit", self.scope, self.round, self.prev, self.new, list(self.members)]
        if self.entry is not None:
            signed.append(self.entry.digest())
        return msgpack.packb(signed)

    def add(self, member: str, public_key: bytes, signature: bytes) -> bool:
        """Add a member's signature if it verifies; True if it does."""
        if member not in self.members or member in self._valid:
            return member in self._valid
        if len(public_key) > MAX_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
            return False
        if peer_id_of_public_key(public_key) != member or not verify_rsa(public_key, self.message(), signature):
            return False
        self.signatures[member] = (public_key, signature)
        self._valid.add(member)
        return True

    def holds(self, admits: Callable[[str], bool] = lambda peer: True) -> bool:
        """More than half of the members signed (and are admitted)."""
        signed = sum(1 for m in self._valid if admits(m))
        return bool(self.members) and signed > len(self.members) // 2

    @property
    def signers(self) -> set[str]:
        return set(self._valid)

    def to_wire(self) -> list:
        return [self.scope, self.round, self.prev, self.new, list(self.members),
                [[m, pk, sig] for m, (pk, sig) in sorted(self.signatures.items())],
                *([self.entry.to_list()] if self.entry is not None else [])]

    @classmethod
    def from_wire(cls, value) -> "CommitCertificate":
        """Parse and check a certificate from a peer (every signature verified); ValueError if malformed."""
        if not isinstance(value, list) or len(value) not in (6, 7):
            raise ValueError("bad_certificate")
        scope, rnd, prev, new, members, sigs = value[:6]
        if not (isinstance(scope, str) and len(scope) <= 256 and isinstance(rnd, int) and not isinstance(rnd, bool)
                and 0 < rnd < 2**53 and all(isinstance(h, str) and len(h) <= _HASH_CHARS for h in (prev, new))
                and isinstance(members, list) and 0 < len(members) <= MAX_MEMBERS
                and all(isinstance(m, str) and len(m) <= 128 for m in members) and members == sorted(set(members))
                and isinstance(sigs, list) and len(sigs) <= len(members)):
            raise ValueError("bad_certificate")
        try:
            entry = Entry.from_list(value[6]) if len(value) == 7 else None
        except ValueError:
            raise ValueError("bad_certificate") from None
        if entry is not None and (entry.round != rnd or list(entry.members) != members):
            raise ValueError("bad_certificate")
        cert = cls(scope, rnd, prev, new, tuple(members), entry)
        for item in sigs:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and isinstance(item[1], bytes) and isinstance(item[2], bytes)):
                raise ValueError("bad_certificate")
            if not cert.add(*item):
                raise ValueError("bad_certificate")
        return cert


def verify_chain(certs: list[CommitCertificate], trusted: dict[int, str], target: tuple[int, str], *, scope: str,
                 admits: Callable[[str], bool] = lambda peer: True) -> tuple[bool, str]:
    """Whether ``certs`` lead from a state in ``trusted`` (round -> params_hash) to ``target``
    (round, params_hash), every link a holding certificate of this run; and why not."""
    by_round = {c.round: c for c in certs if c.scope == scope}
    rnd, params_hash = target
    if trusted.get(rnd) == params_hash:
        return True, ""
    link = by_round.get(rnd)
    if link is None or link.new != params_hash:
        return False, "no_certificate"
    while True:
        if not link.holds(admits):
            return False, "certificate_without_quorum"
        before = link.round - 1
        if trusted.get(before) == link.prev:
            return True, ""
        previous = by_round.get(before)  # we never held that state (or held another: we diverged)
        if previous is None or previous.new != link.prev:
            return False, "chain_breaks"
        link = previous


class CommitLog:
    """This node's chain: the certificate of every round of the state it holds, and the states it trusts."""

    def __init__(self, scope: str, genesis: str, max_certs: int = 1 << 17) -> None:
        self.scope = scope
        self.max_certs = max_certs
        self.certs: dict[int, CommitCertificate] = {}
        self.trusted: dict[int, str] = {0: genesis}  # round -> params_hash of states this node held
        # Ledger entries of the last rounds of the state held (p2p/ledger.py): our own as we
        # committed them (before their certificates hold), or those of certificates we adopted.
        self.entries: dict[int, Entry] = {}

    def hold(self, round: int, params_hash: str) -> None:
        """This node now holds (computed or verified) the state ``params_hash`` at ``round``."""
        self.trusted[round] = params_hash
        for r in [r for r in self.trusted if r > round]:  # a state we replaced is not ours any more
            del self.trusted[r]
            self.certs.pop(r, None)
        for r in [r for r in self.entries if r > round]:
            del self.entries[r]

    def add(self, cert: CommitCertificate) -> None:
        self.certs[cert.round] = cert
        while len(self.certs) > self.max_certs:
            del self.certs[min(self.certs)]
        if cert.entry is not None:
            self.record(cert.entry)

    def record(self, entry: Entry) -> None:
        """The ledger entry of a round this node committed or adopted (the last few are kept)."""
        self.entries[entry.round] = entry
        for r in [r for r in self.entries if r <= entry.round - KEPT_ENTRIES]:
            del self.entries[r]

    def standing(self, round: int) -> Standing:
        """What the entries of the STANDING_ROUNDS rounds up to ``round`` (the state a round starts
        from) say of each peer (``ledger.Standing``)."""
        return Standing((self.entries[r] for r in range(round - STANDING_ROUNDS + 1, round + 1) if r in self.entries),
                        self.entries.get)

    def after(self, round: int, limit: int = MAX_CERTS_PER_REPLY) -> list[CommitCertificate]:
        """Our certificates of rounds after ``round`` (oldest first), at most ``limit``."""
        return [self.certs[r] for r in sorted(self.certs) if r > round][:limit]

    def adopt(self, certs: list[CommitCertificate], round: int, params_hash: str) -> None:
        """After loading a verified state: its chain becomes ours."""
        for cert in certs:
            if cert.round <= round:
                self.add(cert)
        self.hold(round, params_hash)

    def state_dict(self) -> dict:
        return {"trusted": {str(r): h for r, h in self.trusted.items()},
                "certs": [c.to_wire() for c in self.certs.values()],
                "entries": [e.to_list() for e in self.entries.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.trusted = {int(r): h for r, h in state.get("trusted", {}).items()}
        self.certs, self.entries = {}, {}
        for wire in state.get("entries", []):
            self.record(Entry.from_list(wire))
        for wire in state.get("certs", []):
            self.add(CommitCertificate.from_wire(wire))


def encode_certs(certs: list[CommitCertificate]) -> bytes:
    return msgpack.packb([c.to_wire() for c in certs], use_bin_type=True)


def decode_certs(data: bytes) -> list[CommitCertificate]:
    """Certificates from a peer; ValueError if anything is malformed."""
    try:
        value = msgpack.unpackb(data, raw=False, max_array_len=MAX_CERTS_PER_REPLY * 8, max_bin_len=MAX_KEY_BYTES,
                                max_str_len=1 << 16, max_map_len=0, max_ext_len=0)
    except Exception:
        raise ValueError("bad_certificate") from None
    if not isinstance(value, list) or len(value) > MAX_CERTS_PER_REPLY:
        raise ValueError("bad_certificate")
    return [CommitCertificate.from_wire(v) for v in value]
