"""Commit certificates and chains (p2p/commits.py): which state a peer may follow."""

from __future__ import annotations

import pytest

from p2p.commits import CommitCertificate, CommitLog, decode_certs, encode_certs, verify_chain
from p2p.identity import generate_identity
from p2p.records import RecordSigner

pytestmark = pytest.mark.timeout(60)

SCOPE = "run.0123456789abcdef"


@pytest.fixture(scope="module")
def signers():
    return sorted((RecordSigner.from_identity(generate_identity()) for _ in range(4)), key=lambda s: s.peer_id)


def cert(signers, round, prev, new, members=None, signed=None, scope=SCOPE):
    members = members if members is not None else signers
    c = CommitCertificate(scope, round, prev, new, tuple(s.peer_id for s in members))
    for s in (signed if signed is not None else members):
        assert c.add(s.peer_id, s.public_key, s.sign(c.message()))
    return c


def test_a_certificate_holds_with_a_strict_majority_of_its_members_signatures(signers):
    c = cert(signers, 1, "g", "h1", signed=signers[:2])
    assert not c.holds()  # 2 of 4
    assert c.add(signers[2].peer_id, signers[2].public_key, signers[2].sign(c.message()))
    assert c.holds() and c.signers == {s.peer_id for s in signers[:3]}
    assert not c.holds(admits=lambda peer: peer != signers[0].peer_id)  # a closed swarm counts admitted signers


def test_forged_foreign_and_misplaced_signatures_are_refused(signers):
    c = CommitCertificate(SCOPE, 1, "g", "h1", tuple(s.peer_id for s in signers[:3]))
    a, b, c_, outsider = signers
    assert not c.add(a.peer_id, b.public_key, b.sign(c.message()))  # b's key under a's id
    assert not c.add(a.peer_id, a.public_key, a.sign(b"something else"))
    assert not c.add(outsider.peer_id, outsider.public_key, outsider.sign(c.message()))  # not a member
    assert not c.add(a.peer_id, a.public_key, b"\x00" * 256)
    assert c.signers == set()


def test_certificates_survive_the_wire_and_tampering_is_caught(signers):
    c = cert(signers, 3, "h2", "h3")
    (back,) = decode_certs(encode_certs([c]))
    assert back.holds() and back.message() == c.message()
    wire = c.to_wire()
    wire[3] = "h3-forged"  # the new hash changed after signing: no signature verifies
    with pytest.raises(ValueError, match="bad_certificate"):
        CommitCertificate.from_wire(wire)
    for junk in (b"", b"\xc1", encode_certs([]) + b"x"):
        with pytest.raises(ValueError):
            decode_certs(junk)


def test_a_chain_must_start_at_a_trusted_state_and_end_at_the_target(signers):
    chain = [cert(signers, 1, "g", "h1"), cert(signers, 2, "h1", "h2"), cert(signers, 3, "h2", "h3")]
    assert verify_chain(chain, {0: "g"}, (3, "h3"), scope=SCOPE) == (True, "")
    assert verify_chain(chain[1:], {1: "h1"}, (3, "h3"), scope=SCOPE) == (True, "")
    assert verify_chain(chain, {0: "other genesis"}, (3, "h3"), scope=SCOPE) == (False, "chain_breaks")
    assert verify_chain(chain, {0: "g"}, (3, "h3-other"), scope=SCOPE) == (False, "no_certificate")
    assert verify_chain(chain, {0: "g"}, (1003, "x"), scope=SCOPE) == (False, "no_certificate")
    assert verify_chain([chain[0], chain[2]], {0: "g"}, (3, "h3"), scope=SCOPE) == (False, "chain_breaks")
    assert verify_chain(chain, {0: "g"}, (3, "h3"), scope="another.run")[0] is False
    # One peer's self-made chain: a certificate with one member and its signature holds only for
    # a round that one member made; a minority of a round's members cannot certify it.
    weak = [chain[0], chain[1], cert(signers, 3, "h2", "hx", signed=signers[:2])]
    assert verify_chain(weak, {0: "g"}, (3, "hx"), scope=SCOPE) == (False, "certificate_without_quorum")


def test_the_log_keeps_our_lineage_and_adopts_a_verified_chain(signers):
    log = CommitLog(SCOPE, "g")
    log.add(cert(signers, 1, "g", "h1"))
    log.hold(1, "h1")
    assert [c.round for c in log.after(0)] == [1] and log.trusted == {0: "g", 1: "h1"}
    log.hold(2, "mine2")  # we committed round 2 alone; the swarm did otherwise
    theirs = [cert(signers, 2, "h1", "h2"), cert(signers, 3, "h2", "h3")]
    assert verify_chain(theirs, log.trusted, (3, "h3"), scope=SCOPE)[0]
    assert verify_chain(theirs[:1], log.trusted, (2, "h2"), scope=SCOPE)[0]  # diverged at the target's round
    log.adopt(theirs, 3, "h3")
    assert log.trusted[3] == "h3" and log.certs[2].new == "h2"
    log.hold(1, "h1")  # a re-sync back to round 1 forgets what came after it
    assert max(log.trusted) == 1 and max(log.certs) == 1
    restored = CommitLog(SCOPE, "x")
    restored.load_state_dict(log.state_dict())
    assert restored.trusted == log.trusted and restored.certs[1].holds()
