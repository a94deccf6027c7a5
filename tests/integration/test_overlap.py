"""Overlapped rounds in a real swarm: the all-reduce runs during the next round's inner
steps, the global parameters stay bit-identical, and a member killed mid-round leaves
the survivors consistent. With the sparse codec and error feedback, as a large model runs
over the internet: each round works in place over the residual's vector, the owners'
averages keep fewer values than their inputs carry (what they drop goes back to every
member's residual), and an attempt the killed member spoils is put back before the
survivors try again."""

import os
import re
import signal

import pytest

from tests.integration.test_faults import start_swarm, stop_and_check_consistent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SPARSE = ["--set", "swarm.codec=sparse"]


def test_eager_swarm_learns_on_identical_rounds_and_survives_a_member_killed_mid_allreduce(nodes, tmp_path):
    # Four eager peers train together; the fourth dies while it reduces a round of four members
    # from round 4 on, once every peer has committed rounds with the others. The second keeps θ,
    # the momentum, error feedback's residual and every round's pseudo-gradient in memory-mapped
    # files (outer.state_dir): the same bits as the others', round after round.
    swarm = start_swarm(nodes, 4, env_for={1: {"GONKA_OUTER_STATE_DIR": str(tmp_path / "n1-state")},
                                           3: {"GONKA_TEST_FAULT": "reduce@4:4"}},
                        extra=["--overlap", "eager", *SPARSE])
    victim, survivors = swarm[3], swarm[:3]
    assert victim.wait_exit(150) == -signal.SIGKILL, victim.log()[-3000:]
    m = re.search(r"SIGKILL at \w+ of round (\d+)", victim.log())
    assert m, victim.log()[-2000:]
    fault_round = int(m.group(1))
    for n in survivors:
        n.wait_round(fault_round + 2, timeout=150)
    # The swarm learned: every survivor's last training loss is below the highest first loss
    # any of them logged (a peer that started late logs its first loss rounds after the others).
    first = max(n.losses()[0] for n in survivors)
    for n in survivors:
        # From its first commit to the death no round was re-synced: every peer applied every
        # average itself. (A peer that started after the others' first round downloads it.)
        log = n.log()
        since_first = log[log.index("committed round="):]
        resynced = [int(r) for r in re.findall(r"resynced round=(\d+) ", since_first)]
        assert all(r >= fault_round for r in resynced), log[-3000:]
        assert n.losses()[-1] < first, (n.name, n.losses())
    stop_and_check_consistent(survivors)
    assert sorted(os.listdir(tmp_path / "n1-state")) == ["lock", "momentum.f32", "theta.f32"]
