"""Bounds on what peers can make a node hold: stream slots, per-peer tables, handler deadlines."""

import asyncio

import pytest

from p2p.limits import MAX_STREAMS_TOTAL, BoundedDict, StreamLimits, handler_deadline
from p2p.wire import WireError

pytestmark = pytest.mark.timeout(30)


def test_one_peer_cannot_open_more_than_its_streams():
    limits = StreamLimits(per_peer=3)
    assert limits.total == MAX_STREAMS_TOTAL
    assert [limits.acquire("flooder") for _ in range(5)] == [True, True, True, False, False]
    assert limits.acquire("honest")  # others are not held back by one peer's flood
    assert limits.open_streams("flooder") == 3 and limits.open_streams() == 4
    limits.release("flooder")
    assert limits.acquire("flooder") and not limits.acquire("flooder")


def test_all_peers_together_cannot_open_more_than_the_total():
    limits = StreamLimits(per_peer=2, total=5)
    granted = [limits.acquire(f"peer{i}") for i in range(4) for _ in range(2)]
    assert granted.count(True) == 5 and limits.open_streams() == 5
    assert not limits.acquire("newcomer")
    limits.release("peer0")
    assert limits.acquire("newcomer")


def test_released_peers_leave_no_entry_behind():
    limits = StreamLimits(per_peer=4, total=8)
    for i in range(10_000):  # ever new peer ids, each closing its stream
        with limits.slot(f"peer{i}") as admitted:
            assert admitted
    assert limits.open_streams() == 0 and not limits._open


def test_a_refused_slot_releases_nothing():
    limits = StreamLimits(per_peer=1, total=4)
    with limits.slot("a") as first:
        with limits.slot("a") as second:
            assert first and not second
        assert limits.open_streams("a") == 1  # the refused one gave nothing back
    assert limits.open_streams("a") == 0
    with pytest.raises(RuntimeError):
        with limits.slot("a"):
            raise RuntimeError("handler failed")
    assert limits.open_streams() == 0  # released on errors too


def test_bad_stream_limits_are_refused():
    for per_peer, total in [(0, 10), (11, 10)]:
        with pytest.raises(ValueError):
            StreamLimits(per_peer, total)


def test_bounded_dict_drops_the_oldest_entries():
    d = BoundedDict(3)
    for i in range(5):
        d[f"p{i}"] = i
    assert list(d.items()) == [("p2", 2), ("p3", 3), ("p4", 4)]
    d["p2"] = 20  # stored again: now the newest
    d["p5"] = 5
    assert list(d) == ["p4", "p2", "p5"]
    assert d.get("p3") is None and "p4" in d and len(d) == 3
    d.setdefault("p6", 6)
    d.update(p7=7)
    assert list(d) == ["p5", "p6", "p7"] and len(d) == 3
    assert d.pop("p6") == 6 and list(d) == ["p5", "p7"]
    del d["p5"]
    assert dict(d) == {"p7": 7}


def test_bounded_dict_stays_bounded_under_a_flood_and_filters_in_place():
    d = BoundedDict(64)
    for i in range(100_000):
        d[f"sybil{i}"] = i
    assert len(d) == 64 and min(d.values()) == 100_000 - 64
    d.retain(lambda peer, value: value % 2 == 0)
    assert len(d) == 32 and all(v % 2 == 0 for v in d.values()) and isinstance(d, BoundedDict)
    with pytest.raises(ValueError):
        BoundedDict(0)


async def test_a_handler_over_its_deadline_raises_handler_timeout():
    with pytest.raises(WireError) as e:
        async with handler_deadline(0.05):
            await asyncio.sleep(10)  # a peer that never sends the next frame
    assert e.value.reason == "handler_timeout"


async def test_handler_deadline_passes_through_what_it_did_not_cause():
    async with handler_deadline(5):
        await asyncio.sleep(0)  # fast handlers are untouched
    with pytest.raises(WireError, match="bad_field"):
        async with handler_deadline(5):
            raise WireError("bad_field", "x")
    with pytest.raises(TimeoutError):  # an inner timeout that expired is not the handler's
        async with handler_deadline(5):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
