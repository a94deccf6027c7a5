"""Who may commit a round (p2p/quorum.py): pure decisions, no network."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from p2p.quorum import accept_group, can_start, live_peers, quorum, shunned

pytestmark = pytest.mark.timeout(10)


def table(**peers):
    return {p: SimpleNamespace(round=r, state=s) for p, (r, s) in peers.items()}


def test_quorum_is_a_strict_majority_and_min_peers_only_raises_it():
    assert [quorum(n) for n in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]
    assert quorum(4, min_peers=1) == 3 and quorum(4, min_peers=4) == 4 and quorum(2, min_peers=5) == 5


def test_live_peers_are_those_training_at_any_round_and_me():
    # Any round: a group at another round number (a minority ahead or behind) must not commit alone.
    peers = table(a=(3, "training"), b=(3, "ready"), c=(3, "averaging"), d=(3, "joining"), e=(2, "training"),
                  f=(3, "stopped"), g=(1004, "training"))
    assert live_peers(peers, "me") == {"a", "b", "c", "e", "g", "me"}


def test_survivors_of_a_kill_cannot_each_commit_alone():
    # The split brain of issue 14: 4 live peers, one killed; each survivor sees the other three
    # (the dead one's heartbeat has not expired) and only itself ready.
    peers = table(a=(1, "averaging"), b=(1, "ready"), c=(1, "ready"), dead=(1, "averaging"))
    live = live_peers(peers, "a")
    assert can_start(["a"], live, 1) == (False, "1 of 4 live peers ready, 3 needed")
    assert can_start(["a", "b", "c"], live, 1) == (True, "")


def test_two_disjoint_groups_can_never_both_start_one_round():
    live = {"a", "b", "c", "d", "e"}
    for size in range(1, 6):
        for g1 in itertools.combinations(sorted(live), size):
            rest = live - set(g1)
            for size2 in range(1, len(rest) + 1):
                for g2 in itertools.combinations(sorted(rest), size2):
                    assert not (can_start(g1, live, 1)[0] and can_start(g2, live, 1)[0])


def test_a_member_refuses_a_minority_group_from_a_stale_or_lying_leader():
    live = {"a", "b", "c", "d", "me"}
    assert accept_group(["a", "me"], live, 1) == (False, "no_quorum")
    assert accept_group(["a", "b", "me"], live, 1) == (True, "")
    # Members it did not know count as live too: a leader cannot shrink the denominator.
    assert accept_group(["a", "b", "x", "y"], {"a", "b", "me"}, 1) == (True, "")


def test_a_leader_is_shunned_only_once_its_refusers_block_every_quorum():
    live = {"x", "a", "b", "c"}  # a quorum is 3
    assert not shunned([], live) and not shunned(["a"], live)  # x, b, c could still commit
    assert shunned(["a", "b"], live)  # x and c are 2: it can never lead a round that commits
    assert not shunned(["a", "b", "gone"], {"x", "a", "b", "c", "d", "e", "f"})  # 5 of 7 remain
    assert not shunned([], {"x", "me"}, min_peers=3)  # nobody refuses it: a short table is no verdict


def test_a_ready_hint_counts_as_live_before_the_table_shows_it():
    assert can_start(["me", "b", "c"], {"me"}, 3) == (True, "")


def test_one_peers_huge_round_token_claim_cannot_end_everybodys_round():
    from p2p.aggregate import counted_tokens

    assert counted_tokens([100, 120, 90], mine=110) == 310  # honest claims count in full
    assert counted_tokens([100, 2**53 - 1, 90], mine=110) == 100 + 2 * 100 + 90  # the liar: 2x the median
    assert counted_tokens([], mine=5) == 0
