"""State transfer pieces that need no network: choosing the swarm's state, snapshots."""

import pytest
import torch

from p2p.swarm import PeerRecord, parse_peer_record
from p2p.transfer import Snapshot, pick_target

pytestmark = pytest.mark.timeout(10)


def rec(pid: str, rnd: int, h: str, state: str = "training") -> PeerRecord:
    return PeerRecord(pid, state, rnd, h, 0, None, ())


def table(*records: PeerRecord) -> dict[str, PeerRecord]:
    return {r.peer_id: r for r in records}


def test_majority_at_the_newest_round_wins():
    peers = table(rec("a", 3, "x"), rec("b", 3, "y"), rec("c", 3, "y"), rec("d", 2, "z"))
    assert pick_target(peers) == (3, "y", ["b", "c"])
    # Our own vote counts: with it, x ties y and the smaller hash wins on every peer.
    assert pick_target(table(rec("b", 3, "y")), mine=(3, "x")) == (3, "x", [])
    assert pick_target(table(rec("a", 3, "x")), mine=(3, "y")) == (3, "x", ["a"])


def test_newer_round_beats_a_bigger_group_and_joiners_do_not_vote():
    peers = table(rec("a", 5, "n"), rec("b", 4, "o"), rec("c", 4, "o"), rec("j", 9, "q", state="joining"))
    assert pick_target(peers) == (5, "n", ["a"])
    assert pick_target(table(rec("j", 0, "q", state="joining"))) is None


def test_heartbeat_validation_rejects_garbage():
    ok = parse_peer_record("p" * 30, {"state": "ready", "round": 2, "hash": "ab", "step": 5, "loss": 1.5, "maddrs": []})
    assert ok.round == 2 and ok.state == "ready"
    bad_values = [None, [], {"state": "king", "round": 1, "hash": ""}, {"state": "ready", "round": -1, "hash": ""},
                  {"state": "ready", "round": True, "hash": ""}, {"state": "ready", "round": 1, "hash": "h" * 500},
                  {"state": "ready", "round": 1, "hash": "", "maddrs": "x"}]
    for value in bad_values:
        with pytest.raises(ValueError):
            parse_peer_record("p" * 30, value)
    with pytest.raises(ValueError):
        parse_peer_record("short", {"state": "ready", "round": 1, "hash": ""})


def test_snapshot_round_trip_and_chunk_digests():
    params = [torch.randn(3, 4), torch.randn(5)]
    momentum = [torch.randn(3, 4), torch.randn(5)]
    snap = Snapshot.build(7, "h", params, momentum, chunk_bytes=64)
    assert len(snap.blob) == 2 * 17 * 4 and len(snap.chunk_digests) == -(-len(snap.blob) // 64)
    state = snap.unpack()
    assert state["round"] == 7
    assert all(torch.equal(a, b) for a, b in zip(state["params"] + state["momentum"], params + momentum))
