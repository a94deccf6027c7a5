"""State transfer pieces that need no network: choosing the swarm's state, snapshots."""

import pytest
import torch

from p2p.swarm import PeerRecord, parse_peer_record
from p2p.quorum import follow
from p2p.transfer import Snapshot

pytestmark = pytest.mark.timeout(10)


def rec(pid: str, rnd: int, h: str, state: str = "training") -> PeerRecord:
    return PeerRecord(pid, state, rnd, h, 0, None, ())


def table(*records: PeerRecord) -> dict[str, PeerRecord]:
    return {r.peer_id: r for r in records}


def test_the_state_to_follow_is_the_one_a_majority_of_the_other_peers_holds():
    peers = table(rec("a", 3, "x"), rec("b", 3, "y"), rec("c", 3, "y"), rec("d", 2, "z"))
    assert follow(peers, "me") is None  # y has 2 of 4: no majority
    peers["e"] = rec("e", 3, "y")
    assert follow(peers, "me") == (3, "y", ["b", "c", "e"])
    assert follow(table(rec("b", 3, "y")), "me") == (3, "y", ["b"])  # a swarm of two: the other peer


def test_one_peer_or_a_minority_announcing_a_newer_round_is_not_followed():
    honest = [rec(p, 4, "o") for p in "abc"]
    assert follow(table(*honest, rec("liar", 1004, "zeros")), "me") == (4, "o", ["a", "b", "c"])
    liars = [rec(p, 1004, "zeros") for p in ("l1", "l2")]
    assert follow(table(*honest, *liars), "me") == (4, "o", ["a", "b", "c"])
    assert follow(table(*honest[:2], *liars), "me") is None  # half is no majority either


def test_joiners_and_stopped_peers_do_not_vote():
    peers = table(rec("a", 5, "n"), rec("j", 9, "q", state="joining"), rec("s", 9, "q", state="stopped"))
    assert follow(peers, "me") == (5, "n", ["a"])
    assert follow(table(rec("j", 0, "q", state="joining")), "me") is None


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
