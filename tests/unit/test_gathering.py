"""Who is in a round and who leads it (p2p/gathering.py): pure decisions, time as a parameter."""

from __future__ import annotations

import pytest

from p2p.gathering import Gathering, Look, Proposal, leader_of, owners
from p2p.failure import RoundFailed
from p2p.peertable import PeerRecord
from p2p.wire import WireError

ME = "p" * 20 + "b"


def rec(peer: str, state: str, round: int = 3, h: str = "h", reachable: bool | None = None) -> PeerRecord:
    return PeerRecord(peer, state, round, h, 0, None, (), reachable=reachable)


def table(*records: PeerRecord) -> dict:
    return {r.peer_id: r for r in records}


def gathering(started: float = 0.0) -> Gathering:
    return Gathering(ME, 3, "h", started, min_peers=1, gather_timeout=60.0, request_timeout=10.0,
                     heartbeat_interval=2.0)


def look(peers: dict, **kw) -> Look:
    return Look(peers, dict(peers), **kw)


def test_the_smallest_ready_id_leads_once_a_quorum_is_ready_and_nobody_trains():
    a, c = "p" * 20 + "a", "p" * 20 + "c"
    g = gathering()
    assert g.decide(1.0, look(table(rec(c, "ready")))).action == "lead"  # 2 of 2 live ready: us and c
    d = g.decide(1.0, look(table(rec(a, "ready"), rec(c, "ready"))))
    assert (d.action, d.leader, d.ready) == ("wait", a, sorted([a, ME, c]))
    still = g.decide(1.0, look(table(rec(c, "ready"), rec("p" * 20 + "d", "training"))))
    assert still.action == "wait" and still.training == ["p" * 20 + "d"]
    assert g.decide(61.0, look(table(rec(c, "ready"), rec("p" * 20 + "d", "training")))).action == "lead"
    # A peer catching up from one round behind is waited for like one still training (else one
    # whose catch-up outlasts the others' inner steps is left out for good); further behind, not.
    catching_up = table(rec(c, "ready"), rec("p" * 20 + "d", "joining", round=2))
    assert g.decide(1.0, look(catching_up)).action == "wait"
    assert g.decide(61.0, look(catching_up)).action == "lead"
    assert g.decide(1.0, look(table(rec(c, "ready"), rec("p" * 20 + "d", "joining", round=1)))).action == "lead"
    # So is one checking a member's update of the last round before its outer step (p2p/checks.py).
    assert g.decide(1.0, look(table(rec(c, "ready"), rec("p" * 20 + "d", "checking", round=2)))).action == "wait"
    assert g.decide(1.0, look(table(rec(c, "ready")), table_fresh=False)).action == "wait"  # a stale table
    # Another state of the same round is not ready with us; nor is a peer at another round.
    assert g.decide(1.0, look(table(rec(c, "ready", h="other"), rec(a, "ready", round=2)))).ready == [ME]


def test_a_majority_ahead_sends_us_behind_and_a_silent_leader_is_left_out_in_time():
    a, c, d = ("p" * 20 + x for x in "acd")
    assert gathering().decide(1.0, look(table(rec(a, "training", 4), rec(c, "ready", 4)))).action == "behind"
    g = gathering()
    peers = table(rec(a, "ready"), rec(c, "ready"), rec(d, "training"))
    assert g.decide(0.0, look(peers)).action == "wait"
    assert g.decide(79.0, look(peers)).action == "wait"
    out = g.decide(81.0, look(peers))  # gather_timeout + 2 request timeouts of waiting for a
    assert (out.action, out.reason, out.leader) == ("leave_out", "silent_leader", a)
    g = gathering()  # nobody trains any more: an honest leader starts within a few heartbeats
    everyone = table(rec(a, "ready"), rec(c, "ready"))
    assert g.decide(0.0, look(everyone)).action == "wait" and g.decide(24.5, look(everyone)).action == "leave_out"


def test_parts_go_to_the_dialable_members_and_the_first_of_them_leads():
    a, c, d = ("p" * 20 + x for x in "acd")
    peers = table(rec(a, "ready"), rec(c, "ready", reachable=True), rec(d, "ready", reachable=True))
    assert owners([a, ME, c, d], peers, ME, reachable=False) == [c, d]
    assert leader_of([a, ME, c, d], peers, ME, reachable=False) == c
    assert owners([a, ME, c, d], peers, ME, reachable=True) == [ME, c, d]
    assert owners([c, d], peers, ME, reachable=False) is None and leader_of([c, d], peers, ME, False) == c


def test_a_member_checks_the_leaders_proposal():
    a, c = "p" * 20 + "a", "p" * 20 + "c"
    header = {"r": 3, "members": [a, ME, c], "g": b"g" * 16, "numel": 8, "lanes": 4, "codec": "fp32", "h": "h"}
    begin = Proposal.parse(a, header, ME)
    assert begin.refusal(numel=8, state="h", codec="fp32", live={a, ME, c}, min_peers=1) == ""
    assert begin.refusal(numel=8, state="h", codec="int8", live={a, ME, c}, min_peers=1) == "codec_mismatch"
    assert begin.refusal(numel=8, state="x", codec="fp32", live={a, ME, c}, min_peers=1) == "state_mismatch"
    live = {a, ME, c} | {f"q{i}" for i in range(4)}
    assert begin.refusal(numel=8, state="h", codec="fp32", live=live, min_peers=1) == "no_quorum"
    with pytest.raises(RoundFailed, match="bad_size"):
        begin.refusal(numel=9, state="h", codec="fp32", live={a, ME, c}, min_peers=1)
    with pytest.raises(RoundFailed, match="not_a_member"):
        Proposal.parse(c, header, ME)  # only the leader sends begin
    for bad in ({"lanes": 0}, {"members": [ME, a]}, {"owners": [a]}):
        with pytest.raises(WireError):
            Proposal.parse(a, {**header, **bad}, ME)
