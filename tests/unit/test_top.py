"""`gonka-node top`'s screen and the heartbeat field it shows of other peers, without a terminal."""

import pytest

from node.top_cmd import render
from p2p.peertable import parse_observed

pytestmark = pytest.mark.timeout(30)


def test_the_screen_marks_this_node_and_hash_agreement_and_shows_nothing_a_peer_can_break():
    top = {"run_id": "r", "peers": [
        {"peer_id": "Qm" + "a" * 40 + "SELFSELF", "self": True, "state": "ready", "round": 7, "params_hash": "h1",
         "loss": 3.1, "eval_loss": 3.2, "allreduce_s": 0.5, "allreduce_bytes_per_s": 2e6, "aborts": 1},
        {"peer_id": "Qm" + "b" * 40 + "SAMESAME", "state": "training", "round": 7, "params_hash": "h1"},
        {"peer_id": "Qm" + "c" * 40 + "ELSEELSE", "state": "training", "round": 6, "params_hash": "h2",
         "loss": "not a number", "aborts": None},
    ], "aborts": {"timeout": 2, "hostile": 1}, "rejected": {}, "quarantined": {"aborted": 1}}
    screen = render(top, 0.0)
    rows = {line.split()[0]: line for line in screen.splitlines() if line[:1] in "* " and line[1:9].isalnum()}
    assert list(rows) == ["*SELFSELF", "SAMESAME", "ELSEELSE"]  # ours first, then by id
    assert "= h1" in rows["*SELFSELF"] and "= h1" in rows["SAMESAME"] and "≠ h2" in rows["ELSEELSE"]
    assert "2.0" in rows["*SELFSELF"]  # MB/s
    assert "3 peers, 2 on our params_hash" in screen
    assert "aborts: timeout 2, hostile 1" in screen and "rejected: none" in screen
    with pytest.raises(RuntimeError, match="unexpected top reply"):
        render({"peers": []}, 0.0)


@pytest.mark.parametrize("obs", [[1], {"zz": 1.0}, {"el": float("nan")}, {"ar": -1.0}, {"ab": True}, {"el": "3"},
                                 {"el": 1e300}, dict.fromkeys("abcdefgh", 1)])
def test_a_heartbeat_reports_only_known_finite_non_negative_numbers(obs):
    with pytest.raises(ValueError, match="bad_heartbeat_observed"):
        parse_observed(obs)


def test_a_heartbeat_report_is_read_by_its_long_names():
    assert parse_observed({"el": 3.5, "ab": 2}) == {"eval_loss": 3.5, "aborts": 2.0}
    assert parse_observed({}) == {}
