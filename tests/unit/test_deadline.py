"""Adaptive all-reduce deadline: follows observed times within floor and ceiling."""

import pytest

from p2p.deadline import DeadlinePolicy

pytestmark = pytest.mark.timeout(10)


def test_ceiling_until_history_exists():
    assert DeadlinePolicy(ceiling=60).deadline() == 60


def test_follows_high_quantile_with_margin():
    p = DeadlinePolicy(ceiling=60, floor=1, margin=3, quantile=0.9)
    for s in [2.0] * 9 + [4.0]:
        p.observe(s)
    assert p.deadline() == pytest.approx(12.0)  # 0.9 quantile of ten = the slowest, 4 s, times 3


def test_clamped_to_floor_and_ceiling():
    fast = DeadlinePolicy(ceiling=60, floor=5)
    fast.observe(0.01)
    assert fast.deadline() == 5
    slow = DeadlinePolicy(ceiling=60, floor=5)
    slow.observe(100)
    assert slow.deadline() == 60


def test_a_far_member_raises_the_floor_to_forty_round_trips():
    p = DeadlinePolicy(ceiling=60, floor=5)
    p.observe(0.5)  # rounds among near peers
    assert p.deadline() == 5 and p.deadline(rtt=0.001) == 5
    assert p.deadline(rtt=0.25) == pytest.approx(10.0)
    assert p.deadline(rtt=3.0) == 60  # never past the ceiling (swarm.round_timeout)


def test_forgets_old_rounds():
    p = DeadlinePolicy(ceiling=600, floor=1, margin=2, window=3)
    p.observe(100)
    for _ in range(3):
        p.observe(2)
    assert p.deadline() == pytest.approx(4)
