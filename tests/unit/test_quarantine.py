"""Whom to leave out of rounds (p2p/quarantine.py) and the test-only hostile behaviours (p2p/hostile.py)."""

from __future__ import annotations

import pytest

from p2p.hostile import Behaviour, parse
from p2p.quarantine import Quarantine, Refusals

pytestmark = pytest.mark.timeout(10)


def test_a_lie_quarantines_at_once_and_the_quarantine_ends():
    q = Quarantine(seconds=100)
    assert q.offence("liar", "bad_payload", now=0.0) is True
    assert q.quarantined("liar", 50.0) and q.active(50.0) == {"liar"}
    assert q.offence("liar", "bad_payload", now=60.0) is False  # already in
    assert not q.quarantined("liar", 100.0) and q.active(100.0) == set()


def test_faults_are_strikes_and_only_recent_ones_count():
    q = Quarantine(seconds=100, strikes=3)
    assert not q.offence("p", "aborted", 0.0) and not q.offence("p", "refused", 10.0)
    assert not q.offence("p", "aborted", 150.0)  # the first two are older than the period
    assert not q.offence("p", "silent_leader", 160.0)
    assert q.offence("p", "uncertified_state", 170.0) and q.quarantined("p", 171.0)


def test_starting_the_aborts_of_two_attempts_in_a_row_quarantines():
    q = Quarantine(seconds=100, strikes=3)
    # x spoils an attempt; the next one commits; x spoils one again: two strikes, not in a row.
    assert q.attempt_over("x", False, 0.0) == "aborted" and not q.offence("x", "aborted", 0.0)
    assert q.attempt_over(None, False, 1.0) is None
    assert q.attempt_over("x", False, 10.0) == "aborted" and not q.offence("x", "aborted", 10.0)
    # y spoils one in between: x's next is not in a row with its last either.
    assert q.attempt_over("y", False, 11.0) == "aborted"
    assert q.attempt_over("x", False, 12.0) == "aborted"
    # x spoils the very next one too: quarantined at once, whatever its strikes.
    assert q.attempt_over("x", False, 13.0) == "aborted_again"
    assert q.offence("x", "aborted_again", 13.0) and q.quarantined("x", 14.0)
    assert not q.quarantined("y", 14.0)
    # Our next attempt a quarantine period later (we were behind meanwhile, say) is no row.
    assert q.attempt_over("y", False, 20.0) == "aborted"
    assert q.attempt_over("y", False, 120.0) == "aborted"
    # An abort that names the member it failed on (one that died, say) is a strike only, and
    # starts no run: z, naming a culprit each time, is never "again".
    assert q.attempt_over("z", True, 130.0) == "aborted"
    assert q.attempt_over("z", True, 131.0) == "aborted"
    assert q.attempt_over("z", False, 132.0) == "aborted"
    assert q.attempt_over("z", True, 133.0) == "aborted"
    assert q.attempt_over("z", False, 134.0) == "aborted"


def test_an_abort_for_a_member_it_could_not_dial_is_no_offence_however_often():
    q = Quarantine(seconds=100, strikes=3)
    for t in range(10):  # what a NAT or lost SYNs do, attempt after attempt
        assert q.attempt_over("x", True, float(t), "unreachable") is None
    assert not q.quarantined("x", 10.0)
    # ...but only when it names whom it could not dial; and it breaks no run of unexplained aborts.
    assert q.attempt_over("x", False, 20.0, "unreachable") == "aborted"
    assert q.attempt_over("x", True, 21.0, "unreachable") is None
    assert q.attempt_over("x", False, 22.0, "timeout") == "aborted"


def test_the_tables_are_bounded_whoever_offends():
    q = Quarantine(seconds=100, max_peers=16)
    for i in range(1000):
        q.offence(f"p{i}", "bad_weight", 0.0)
        q.offence(f"s{i}", "aborted", 0.0)
    assert len(q.active(1.0)) == 16


def test_hostile_behaviours_parse_and_bad_ones_name_the_variable():
    assert parse("") == Behaviour() and not parse("").any
    assert parse("scale=-1000, weight=1e30,abort") == Behaviour(scale=-1000.0, weight=1e30, abort=True)
    assert parse("fake_state,fake_states") == Behaviour(fake_state=True, fake_states=True)
    for bad in ("scale", "abort=1", "king", "fill=x"):
        with pytest.raises(ValueError, match="GONKA_TEST_HOSTILE"):
            parse(bad)


def test_test_hooks_are_read_once_from_the_environment_and_bad_ones_name_the_variable():
    from node.config import FaultInjection, load_injection
    from node.errors import ConfigError
    from p2p.faults import Faults

    assert load_injection({}) == FaultInjection() and not load_injection({}).faults.any
    hooks = load_injection({"GONKA_TEST_FAULT": "reduce@2:4", "GONKA_TEST_HOLD_FIRST_DOWNLOAD": "3",
                            "GONKA_TEST_HOSTILE": "abort"})
    assert hooks.faults == Faults("reduce", 2, 4, 3.0) and hooks.hostile == Behaviour(abort=True)
    for var, bad in (("GONKA_TEST_FAULT", "explode@2"), ("GONKA_TEST_FAULT", "reduce@x"),
                     ("GONKA_TEST_HOLD_FIRST_DOWNLOAD", "-1"), ("GONKA_TEST_HOSTILE", "king")):
        with pytest.raises(ConfigError, match=var):
            load_injection({var: bad})


def test_refusals_stand_for_the_quarantine_period_and_are_told_each_peer_once_a_round():
    r = Refusals(seconds=100, max_claims=2)
    r.told_us("a", "x", now=0.0)
    r.told_us("b", "x", now=50.0)
    assert sorted(r.refusers("x", 60.0)) == ["a", "b"] and r.refusers("y", 60.0) == []
    assert r.refusers("x", 120.0) == ["b"]  # a's claim is over
    r.told_us("c", "x", now=130.0)  # bounded: the oldest claim gives way
    assert sorted(r.refusers("x", 130.0)) == ["b", "c"]
    r.told_us("d", "x", now=131.0)
    assert sorted(r.refusers("x", 131.0)) == ["c", "d"]
    assert r.to_tell("x", 3, ["a", "x", "b"]) == ["a", "b"]  # never the leader itself
    assert r.to_tell("x", 3, ["b", "c"]) == ["c"]  # each peer once a round, whichever group it was in
    assert r.to_tell("x", 4, ["b"]) == ["b"]
