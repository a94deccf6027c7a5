"""Three nodes form a swarm from one bootstrap address, train in lockstep, and a
fourth joins mid-run through the second node's address."""

import json
import os
import re
import signal
import subprocess

import pytest

from tests.integration.nodes import BIN, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]



def test_three_nodes_then_a_joiner(nodes, tmp_path):
    # All four train until the test stops them (--max-rounds counts the swarm's rounds,
    # and the joiner's start-up time on a busy machine is unknown).
    common = ["--inner-steps", "8", "--min-peers", "3"]
    first = nodes("n1", *common)
    addr1 = first.address()
    second = nodes("n2", *common, "--bootstrap", addr1)
    third = nodes("n3", *common, "--bootstrap", addr1)
    trio = [first, second, third]
    for n in trio:
        n.wait_round(3, timeout=150)

    # The control API answers while the node runs.
    out = subprocess.run([str(BIN), "status", "--control", first.control, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["peer_id"] and status["round"] >= 3 and status["params_hash"]
    assert status["multiaddrs"] == [addr1]

    # Bootstrapping through the *second* node, not the one that started the swarm. The joiner
    # keeps θ and the momentum in memory-mapped files (outer.state_dir), its download too.
    fourth = nodes("n4", "--inner-steps", "8", "--bootstrap", second.address(),
                   "--set", f"outer.state_dir={tmp_path / 'n4-state'}")
    wait_until(lambda: fourth.log().count("members=4") >= 2 or fourth.proc.poll() is not None, 150,
               "the joiner to commit two rounds with the others")
    everyone = [*trio, fourth]
    for n in everyone:
        n.proc.send_signal(signal.SIGTERM)
    for n in everyone:
        assert n.wait_exit(timeout=60) == 0, n.log()[-3000:]

    # Every round any node committed (or re-synced to) has one params_hash swarm-wide.
    by_round: dict[int, set[str]] = {}
    for n in everyone:
        for r, h in n.rounds().items():
            by_round.setdefault(r, set()).add(h)
    assert all(len(hashes) == 1 for hashes in by_round.values()), by_round
    # The first three committed rounds 1..3 together.
    for n in trio:
        assert {1, 2, 3} <= set(n.rounds()), n.log()[-2000:]
        assert "members=3" in n.log()
        losses = n.losses()
        assert losses[-1] < losses[0], losses  # training loss falls
    # The joiner downloaded the state first, then committed rounds with all four.
    log4 = fourth.log()
    assert log4.index("reason=join") < log4.index("committed round=")
    assert re.search(r"downloaded round \d+ state", log4), log4[-2000:]
    assert sorted(os.listdir(tmp_path / "n4-state")) == ["lock", "momentum.f32", "theta.f32"]
    joined_rounds = [int(r) for r in re.findall(r"committed round=(\d+) .*members=4", log4)]
    assert len(joined_rounds) >= 2, log4[-2000:]
    for n in trio:  # the joiner ends its rounds on the same parameters as the others
        assert n.rounds()[joined_rounds[-1]] == fourth.rounds()[joined_rounds[-1]]
    assert {n.status()["state"] for n in everyone} == {"stopped"}
