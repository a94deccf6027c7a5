"""Checks of sampled members (p2p/checks.py): who checks whom, verdicts, records, and what the
ledger makes of them. Pure functions and signed records; the checks in real rounds run in
tests/integration/test_hostile.py and scripts/attack.py."""

import pytest

from p2p.checks import (CHECKERS, CHECKED, MIN_ADVANTAGE, CheckRecord, assignments, failed, judge, judged,
                        signed_message)
from p2p.identity import generate_identity
from p2p.ledger import STANDING_ROUNDS, Entry, Row, Standing, passed, revoked
from p2p.records import RecordSigner

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def signers():
    return sorted((RecordSigner.from_identity(generate_identity()) for _ in range(5)), key=lambda s: s.peer_id)


def record(signer, sampled: str, round: int, gains: tuple) -> CheckRecord:
    return CheckRecord("scope", round, sampled, signer.peer_id, gains, signer.public_key,
                       signer.sign(signed_message("scope", round, sampled, signer.peer_id, gains)))


def test_the_beacon_samples_dialable_members_and_gives_each_distinct_checkers():
    members = [f"p{i}" for i in range(6)]
    a = assignments(b"beacon", members)
    assert len(a) == CHECKED and all(len(c) == CHECKERS and s not in c and len(set(c)) == CHECKERS
                                     for s, c in a.items())
    assert assignments(b"beacon", members) == a and assignments(b"other", members) != a
    assert set(assignments(b"beacon", members, owners=["p1", "p4"])) <= {"p1", "p4"}
    assert assignments(b"beacon", ["p0", "p1"]) == {}  # two members: nobody is checked
    # A member's first round (not in the round before) is not checked: its optimizer warms up.
    assert set(assignments(b"beacon", members, checked=6, veterans={"p2", "p3", "p5"})) == {"p2", "p3", "p5"}


# (member on its windows A, on the checker's B, on control C; checker on A, B, C; θ on C)
HONEST = (2.0, 2.2, 2.2, 2.2, 2.0, 2.2, 2.3)


@pytest.mark.parametrize("gains,flags", [
    ((), ("withheld",)),
    (HONEST, ()),  # learned its windows as well as the checker did its own
    ((2.1, 2.3, 2.3, 2.2, 2.0, 2.2, 2.3), ()),  # slow: less far in general, still ahead on its windows
    ((2.2, 2.2, 2.2, 2.2, 2.0, 2.2, 2.3), ("unassigned",)),  # no better on its windows than on any: other data
    ((2.16, 2.2, 2.2, 2.2, 2.0, 2.2, 2.3), ("unassigned",)),  # an advantage below UNASSIGNED of the checker's
    ((2.3, 2.5, 2.55, 2.2, 2.0, 2.2, 2.3), ("unassigned",)),  # ahead on its windows, yet worse there than a
    # model that never saw them, by more than UNASSIGNED of the reference
    ((2.23, 2.4, 2.45, 2.2, 2.0, 2.2, 2.3), ()),  # a slow host: a little worse there, well ahead of its control
    ((2.5, 2.5, 2.5, 2.2, 2.0, 2.2, 2.3), ("unassigned",)),  # a stale update, noise or none
    ((2.2, 2.2, 2.2, 2.2, 2.19, 2.2, 2.3), ()),  # the checker's own advantage too small to tell
    ((2.2, 2.2, 2.2, 2.2, 2.0, 2.2, 2.0 + 2.2 * MIN_ADVANTAGE), ()),  # ... next to its general gain
    ((2.2, 2.2, 2.2, 2.2, 2.0, 2.2, 2.1), ("unassigned",)),  # late in a run: updates overshoot on other data
])
def test_a_verdict_follows_from_the_gains(gains, flags):
    assert judge(gains) == flags


def test_a_record_is_signed_by_its_checker_and_its_verdict_is_its_gains(signers):
    r = record(signers[0], signers[1].peer_id, 4, (2.2, 2.2, 2.2, 2.2, 2.0, 2.2, 2.3))
    again = CheckRecord.from_wire(r.to_wire())
    assert again == r and again.flags == ("unassigned",)
    wire = r.to_wire()
    wire[4] = list(HONEST)  # the gains changed after signing: the verdict would differ
    with pytest.raises(ValueError):
        CheckRecord.from_wire(wire)
    wire = r.to_wire()
    wire[3] = signers[2].peer_id  # signed by another key than the checker's
    with pytest.raises(ValueError):
        CheckRecord.from_wire(wire)
    # Gains of another shape (the 4 of an older format), or not finite, are refused as they come,
    # even signed by the checker.
    for gains in ((0.2, 0.1, 0.2, 0.1), (float("nan"),) * 7, (2.2,) * 6 + (float("inf"),), (2.2,) * 8):
        with pytest.raises(ValueError):
            CheckRecord.from_wire(record(signers[0], signers[1].peer_id, 4, gains).to_wire())


def row(peer: str, flags: tuple[str, ...] = ()) -> Row:
    return Row(peer, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0, 1.0, flags, 0.0 if flags else 1.0)


def test_a_member_fails_a_check_only_when_every_checker_flags_it_and_twice_is_left_out(signers):
    peers = [s.peer_id for s in signers]
    by_id = {s.peer_id: s for s in signers}
    entries = {r: Entry(r, tuple(row(p) for p in peers)) for r in range(1, 4)}
    plan = {1: assignments(entries[1].digest(), peers)}
    bad = (2.2, 2.2, 2.2, 2.2, 2.0, 2.2, 2.3)
    # Round 1: the first sampled member is flagged by both its checkers; the second by one only.
    s1, s2 = list(plan[1])
    records = [record(by_id[c], s1, 1, bad) for c in plan[1][s1]]
    records += [record(by_id[plan[1][s2][0]], s2, 1, bad), record(by_id[plan[1][s2][1]], s2, 1, HONEST)]
    assert failed(records, lambda r, s: plan.get(r, {}).get(s)) == {(s1, 1)}
    entries[2] = Entry(2, entries[2].rows, tuple(records))
    plan[2] = assignments(entries[2].digest(), peers)  # its beacon is the entry with the records
    standing = Standing([entries[1], entries[2]], entries.get)
    assert standing.factor(s1) == 1.0 and standing.factor(s2) == 1.0  # one failure: not yet confirmed
    # Failed again for round 2 (any sampled member of it): confirmed, two flagged rounds, left out.
    s = s1 if s1 in plan[2] else next(iter(plan[2]))
    entries[3] = Entry(3, entries[3].rows, tuple(record(by_id[c], s, 2, bad) for c in plan[2][s]))
    standing = Standing([entries[1], entries[2], entries[3]], entries.get)
    assert standing.factor(s) == (0.0 if s == s1 else 1.0)
    # A flagged row counts at once; a single failed check still adds nothing to it.
    entries[2] = Entry(2, tuple(row(p, flags=("idle",) if p == s1 else ()) for p in peers), tuple(records))
    assert Standing([entries[1], entries[2]], entries.get).factor(s1) == 0.25
    # The entry's checks travel with it: msgpack and JSON give back the same digest.
    assert Entry.from_list(entries[2].to_list()).digest() == entries[2].digest()
    assert Entry.from_json(entries[2].to_json()).digest() == entries[2].digest()


TOO_EARLY = (2.2, 2.2, 2.2, 2.2, 2.19, 2.2, 2.3)  # the checker's own advantage too small: no verdict
FLAGGED = (2.2, 2.2, 2.2, 2.2, 2.0, 2.2, 2.3)


def test_a_failed_check_takes_back_the_credit_since_the_last_passed_one_once_confirmed(signers):
    c1, c2, member = signers[0], signers[1], signers[2].peer_id
    assert judged(HONEST) and judged(FLAGGED) and not judged(TOO_EARLY) and not judged(())
    checks = {1: (TOO_EARLY, TOO_EARLY), 2: (FLAGGED, FLAGGED), 3: (FLAGGED, HONEST), 4: (HONEST, HONEST),
              5: (HONEST, TOO_EARLY), 7: (FLAGGED, FLAGGED)}
    records = [record(c, member, rnd, g) for rnd, pair in checks.items() for c, g in zip((c1, c2), pair)]
    checkers = lambda rnd, sampled: (c1.peer_id, c2.peer_id) if sampled == member else None  # noqa: E731
    assert failed(records, checkers) == {(member, 2), (member, 7)}
    assert passed(records, checkers) == {(member, 4)}  # round 5: one checker could not tell
    # Two failures: rounds 1-2 (nothing passed before the first) and 5-7 (since round 4, which
    # passed). Round 6 was not checked, 8 came after: both stand, and so do another peer's rounds.
    rounds = {member: range(1, 9), signers[3].peer_id: range(1, 9)}
    assert revoked(records, checkers, rounds) == {(member, r) for r in (1, 2, 5, 6, 7)}
    # Only rounds it was a member of; a check whose checkers are unknown counts for nothing.
    assert revoked(records, checkers, {member: [2, 6]}) == {(member, 2), (member, 6)}
    assert revoked(records, lambda rnd, sampled: None, rounds) == set()
    # One failure alone (an honest slow host in its warmup, say) costs that round only; two
    # further apart than the standing's window do not confirm each other either.
    alone = [r for r in records if r.round != 7]
    assert revoked(alone, checkers, rounds) == {(member, 2)}
    far = alone + [record(c, member, 2 + STANDING_ROUNDS, FLAGGED) for c in (c1, c2)]
    assert revoked(far, checkers, {member: range(1, 30)}) == {(member, 2), (member, 2 + STANDING_ROUNDS)}
