"""Overlapped rounds in a real swarm: the all-reduce runs during the next round's inner
steps, the global parameters stay bit-identical, and a member killed mid-round leaves
the survivors consistent. With int8 and error feedback, as a large model runs: each
round works in place over the residual's vector, and an attempt the killed member spoils
is put back before the survivors try again (p2p/group.py, Group.restore)."""

import re
import signal

import pytest

from tests.integration.test_faults import start_swarm, stop_and_check_consistent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

INT8 = ["--set", "swarm.codec=int8"]


def test_eager_swarm_commits_identical_rounds_and_learns(nodes):
    swarm = start_swarm(nodes, 3, extra=["--overlap", "eager", *INT8])
    for n in swarm:
        n.wait_round(4, timeout=200)
    for n in swarm:
        log = n.log()
        # No round was re-synced: every peer applied every average itself.
        assert "resynced" not in log, log[-3000:]
        assert n.losses()[-1] < n.losses()[0]
    stop_and_check_consistent(swarm)
    for n in swarm:
        assert len(n.rounds()) >= 4


def test_eager_member_killed_mid_allreduce_survivors_stay_consistent(nodes):
    swarm = start_swarm(nodes, 4, env_for={3: {"GONKA_TEST_FAULT": "reduce@2:4"}},
                        extra=["--overlap", "eager", *INT8])
    victim, survivors = swarm[3], swarm[:3]
    assert victim.wait_exit(150) == -signal.SIGKILL, victim.log()[-3000:]
    m = re.search(r"SIGKILL at \w+ of round (\d+)", victim.log())
    assert m, victim.log()[-2000:]
    fault_round = int(m.group(1))
    for n in survivors:
        n.wait_round(fault_round + 2, timeout=150)
    stop_and_check_consistent(survivors)
