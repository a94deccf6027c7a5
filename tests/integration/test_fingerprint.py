"""A peer started on the same run id with another model is refused on both sides:
the swarm never counts, waits for or follows it, and the joiner exits 2 naming what differs."""

import re
import signal

import pytest

from tests.integration.nodes import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_another_model_is_refused_on_both_sides(nodes):
    common = ["--inner-steps", "6", "--min-peers", "2"]
    first = nodes("n1", *common)
    addr = first.address()
    second = nodes("n2", *common, "--bootstrap", addr)
    for n in (first, second):
        n.wait_round(2, timeout=150)

    # Same run id, another --model: it sees only peers of another run and gives up.
    stranger = nodes("n3", *common, "--model", "small", "--bootstrap", addr)
    assert stranger.wait_exit(timeout=120) == 2, stranger.log()[-3000:]
    errors = [line for line in stranger.log().splitlines() if line.startswith("gonka-node: error:")]
    assert len(errors) == 1, stranger.log()[-3000:]
    assert re.search(r"swarm.bootstrap: the swarm of run 'default' trains another run: .*different model config", errors[0])

    # The swarm refused it too, and went on committing rounds of two, never three.
    wait_until(lambda: all("refusing peer" in n.log() for n in (first, second)), 60, "both peers to refuse n3")
    reached = max(first.rounds())
    for n in (first, second):
        n.wait_round(reached + 1, timeout=150)
    for n in (first, second):
        log = n.log()
        line = next(l for l in log.splitlines() if "refusing peer" in l)
        assert "different model config" in line
        assert "members=3" not in log and "resynced" not in log
    for n in (first, second):
        n.proc.send_signal(signal.SIGTERM)
    for n in (first, second):
        assert n.wait_exit(timeout=60) == 0, n.log()[-3000:]
    common_rounds = set(first.rounds()) & set(second.rounds())
    assert len(common_rounds) >= reached + 1
    assert all(first.rounds()[r] == second.rounds()[r] for r in common_rounds)


def test_a_checkpoint_of_another_run_is_refused(nodes, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = nodes("first", "--inner-steps", "3", "--max-rounds", "1", "--checkpoint-dir", ckpt)
    assert first.wait_exit(timeout=120) == 0, first.log()[-3000:]
    again = nodes("again", "--inner-steps", "3", "--max-rounds", "2", "--checkpoint-dir", ckpt,
                  "--set", "outer.lr=0.5")
    assert again.wait_exit(timeout=120) == 2, again.log()[-3000:]
    errors = [line for line in again.log().splitlines() if line.startswith("gonka-node: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "gonka-node: error: node.checkpoint_dir: holds a checkpoint of another run: different outer settings "
        "(this node lr=0.5,"), errors
    assert "committed" not in again.log()
