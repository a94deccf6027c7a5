"""The ledger file: the node's commit certificates and their ledger entries, for other systems.

JSON Lines, one line per committed round whose certificate holds and carries a ledger
entry (p2p/commits.py, p2p/ledger.py), oldest first::

    {"scope", "round", "prev", "new", "members": [...], "entry": Entry.to_json(),
     "signatures": [{"peer", "public_key": base64, "signature": base64}, ...]}

Everything a reader needs to check it offline is in the file: the members' public keys
(whose hashes are their peer ids) and their signatures on the certificate's message,
which covers the entry's digest. JSON writes floats as Python's ``repr``, which reads
back as the same float, so an entry read from the file packs to the bytes its members
signed. Format and how to verify it without this code: docs/ledger.md.

A file is read without checking any signature (``read_ledger``: the certificates come
back with their signatures unchecked, holding nothing), so that ``verify_ledger`` can
name the first round that is wrong instead of refusing the whole file.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Iterable

from p2p.commits import CommitCertificate, CommitLog
from p2p.ledger import Entry

FILE_NAME = "ledger.jsonl"  # in the node's checkpoint directory (node/checkpoints.py)


class NotLedgerLines(ValueError):
    """A line of the file is not JSON, not an object, or lacks a ledger line's keys: this is not a
    ledger file at all (a line with the keys but wrong values is a ledger that does not verify)."""


def ledger_certificates(commits: CommitLog) -> list[CommitCertificate]:
    """The certificates of ``commits`` that the file holds, oldest first: those that hold and carry
    an entry. Each is a copy with its signatures as they are now, so the file can be written off
    the event loop that keeps adding signatures to the originals."""
    return [CommitCertificate(c.scope, c.round, c.prev, c.new, c.members, c.entry, dict(c.signatures))
            for _, c in sorted(commits.certs.items()) if c.entry is not None and c.holds()]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def ledger_line(cert: CommitCertificate) -> str:
    """One certificate as a line of the file (without its newline)."""
    assert cert.entry is not None
    line = {"scope": cert.scope, "round": cert.round, "prev": cert.prev, "new": cert.new,
            "members": list(cert.members), "entry": cert.entry.to_json(),
            "signatures": [{"peer": peer, "public_key": _b64(key), "signature": _b64(sig)}
                           for peer, (key, sig) in sorted(cert.signatures.items())]}
    return json.dumps(line, separators=(",", ":"), allow_nan=False)


def write_ledger(path: str, certs: Iterable[CommitCertificate]) -> int:
    """Write ``certs`` (``ledger_certificates``) to ``path`` atomically; the number of lines."""
    from trainer.files import atomic_write

    lines = [ledger_line(c) + "\n" for c in certs]
    atomic_write(path, lambda f: f.writelines(line.encode("utf-8") for line in lines))
    return len(lines)


def _certificate(value, number: int) -> CommitCertificate:
    """A line's certificate, its signatures kept as they are (unchecked); ValueError if malformed."""
    rnd = value.get("round")
    where = f"line {number} (round {rnd})" if isinstance(rnd, int) else f"line {number}"
    keys = ("scope", "round", "prev", "new", "members", "entry", "signatures")
    missing = [k for k in keys if k not in value]
    if missing:
        raise NotLedgerLines(f"{where}: not a ledger line, no {', '.join(missing)}")
    try:
        entry = Entry.from_json(value["entry"])
    except ValueError:
        raise ValueError(f"{where}: entry malformed") from None
    members = value["members"]
    try:
        # The certificate's own checks (sizes, round, members sorted and distinct, the entry of this
        # round and members), with no signature yet: those are checked by ``verify_ledger``.
        cert = CommitCertificate.from_wire([value["scope"], rnd, value["prev"], value["new"], members, [],
                                            entry.to_list()])
    except ValueError:
        raise ValueError(f"{where}: scope, round, prev, new or members malformed, or not the entry's") from None
    sigs = value["signatures"]
    if not (isinstance(sigs, list) and len(sigs) <= len(cert.members)):
        raise ValueError(f"{where}: signatures malformed")
    for item in sigs:
        if not (isinstance(item, dict) and isinstance(item.get("peer"), str)
                and isinstance(item.get("public_key"), str) and isinstance(item.get("signature"), str)):
            raise ValueError(f"{where}: signatures malformed")
        if item["peer"] in cert.signatures:
            raise ValueError(f"{where}: two signatures of {item['peer']}")
        try:
            key = base64.b64decode(item["public_key"], validate=True)
            sig = base64.b64decode(item["signature"], validate=True)
        except binascii.Error:
            raise ValueError(f"{where}: signature of {item['peer']} is not base64") from None
        cert.signatures[item["peer"]] = (key, sig)
    return cert


def read_ledger(path: str) -> list[CommitCertificate]:
    """The certificates of a ledger file, in file order, their signatures unchecked (they hold
    nothing until ``verify_ledger`` checks them). OSError if it cannot be read; NotLedgerLines if a
    line is not a JSON object with a ledger line's keys; ValueError naming the line (and its round)
    if a line's values are malformed."""
    certs = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise NotLedgerLines(f"line {number}: not JSON") from None
            if not isinstance(value, dict):
                raise NotLedgerLines(f"line {number}: not a JSON object")
            certs.append(_certificate(value, number))
    return certs


def signed(cert: CommitCertificate) -> int:
    """How many members' signatures in ``cert`` verify against its message (which covers its
    entry's digest): checked here, by ``CommitCertificate.add`` on a fresh copy."""
    checked = CommitCertificate(cert.scope, cert.round, cert.prev, cert.new, cert.members, cert.entry)
    return sum(checked.add(peer, key, sig) for peer, (key, sig) in cert.signatures.items())


def verify_ledger(certs: list[CommitCertificate]) -> tuple[bool, int | None, str]:
    """Whether ``certs`` (a file's, in file order) are one unbroken chain of holding certificates
    with their entries: (True, None, what was verified) or (False, the first bad round, why).

    Each line: its entry is of its round and members; more than half of its members signed its
    message (entry digest included: a changed entry fails every signature). Between lines: one
    scope; rounds increase by exactly 1; each line's prev is the line before's new. The first
    line's prev is checked against nothing (at round 1, the genesis a peer computes from the
    run's fingerprint)."""
    if not certs:
        return True, None, "no entries"
    scope = certs[0].scope
    rounds = {c.round for c in certs}
    before: CommitCertificate | None = None
    for cert in certs:
        r = cert.round
        if cert.scope != scope:
            return False, r, f"round {r}: scope {cert.scope!r} is not the ledger's {scope!r}"
        if cert.entry is None or cert.entry.round != r or cert.entry.members != cert.members:
            return False, r, f"round {r}: the entry is not of this round and members"
        k, m = signed(cert), len(cert.members)
        if k <= m // 2:
            return False, r, f"round {r}: signatures do not hold ({k} of {m})"
        if before is not None:
            last = before.round
            if r <= last or (r > last + 1 and any(last < n < r for n in rounds)):
                return False, r, f"round {r}: out of order after round {last}"
            if r > last + 1:
                gap = f"{last + 1}" if r == last + 2 else f"{last + 1}..{r - 1}"
                return False, r, f"round {r}: missing round {gap} after round {last}"
            if cert.prev != before.new:
                return False, r, f"round {r}: forks: prev {cert.prev} is not round {last}'s new {before.new}"
        before = cert
    first, last = certs[0].round, certs[-1].round
    return True, None, f"rounds {first}..{last} ({len(certs)} entries)"
