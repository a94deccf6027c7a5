"""Injected faults in real swarms on loopback: a member SIGKILLed at each phase of a
round (one swarm, one death at a time), a member SIGSTOPped past the deadline (and its
first download held), a donor killed mid-download.
Every test ends by checking that all survivors hold the same parameters."""

import re
import signal
import time

import pytest

from tests.integration.nodes import BOUND, check_recovered, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

COMMON = ["--inner-steps", "8", "--min-peers", "3"]


def start_swarm(nodes, n: int, env_for: dict[int, dict] | None = None, extra=()):
    first = nodes("n0", *COMMON, *extra, env=(env_for or {}).get(0))
    addr = first.address()
    rest = [nodes(f"n{i}", *COMMON, *extra, "--bootstrap", addr, env=(env_for or {}).get(i)) for i in range(1, n)]
    return [first, *rest]


def stop_and_check_consistent(survivors) -> None:
    """SIGTERM everyone, then: every round has one hash, and all end on the same state."""
    for n in survivors:
        n.proc.send_signal(signal.SIGTERM)
    for n in survivors:
        assert n.wait_exit(60) == 0, n.log()[-3000:]
    by_round: dict[int, set[str]] = {}
    for n in survivors:
        for r, h in n.rounds().items():
            by_round.setdefault(r, set()).add(h)
    last = min(max(n.rounds()) for n in survivors)
    assert len(by_round[last]) == 1, by_round[last]
    assert all(len({n.rounds()[r] for n in survivors if r in n.rounds()}) == 1 for r in by_round), by_round


# A member killed in the reduce phase: tests/integration/test_hostile.py, under CPU load.
# One swarm of six loses a member at each of the three other phases, one death at a time: the
# first when grouped (round >= 2), the next at gather (round >= 6) once the swarm has recovered
# and committed again, the last at commit (round >= 10), each in a group of at least 4.
PHASES = (("grouped", 2), ("gather", 6), ("commit", 10))


def test_sigkill_a_member_at_each_phase_of_a_round(nodes):
    victims_at = {5 - i: f"{phase}@{round}:4" for i, (phase, round) in enumerate(PHASES)}
    swarm = start_swarm(nodes, 6, env_for={i: {"GONKA_TEST_FAULT": fault} for i, fault in victims_at.items()})
    alive = list(swarm)
    for i, (phase, _) in zip(victims_at, PHASES):
        victim = swarm[i]
        assert victim.wait_exit(150) == -signal.SIGKILL, victim.log()[-3000:]
        died = time.time()
        alive.remove(victim)
        m = re.search(rf"SIGKILL at {phase} of round (\d+)", victim.log())
        assert m, victim.log()[-2000:]
        fault_round = int(m.group(1))
        for n in alive:
            n.wait_round(fault_round + 1, timeout=BOUND + 60)
        check_recovered(alive, fault_round, died)
        if phase != "commit":
            assert any(f"aborted round={fault_round}" in n.log() for n in alive), phase
    survivors = swarm[:3]
    assert alive == survivors
    ids = {n.peer_id()[-8:] for n in survivors}  # the aborts the deaths set off quarantine no survivor
    assert not any(n.quarantined() & ids for n in survivors), [(n.name, n.quarantined()) for n in survivors]
    stop_and_check_consistent(survivors)


def test_sigstopped_member_is_left_out_then_resyncs(nodes):
    # The sleeper joins a swarm 8 rounds in (it has no state: it downloads one), and that
    # download is held 3 s once the donors described
    # it: several of the swarm's rounds commit meanwhile, as while a big state crosses the
    # internet. The donors keep serving the state it began on, and the averages of the rounds
    # since: it takes their outer steps itself, each checked against its certificate, instead
    # of downloading the state again, and never trains for a round the swarm has finished (it
    # would be one round behind at every gather then).
    # The sparse codec: the averages kept for catch-up are in its averages' own format, ~1/60
    # of the state each; donors keep the last 5 of them (with all of them kept, a joiner
    # would take every round's step from θ as built instead of downloading the state).
    sparse = ["--set", "swarm.codec=sparse", "--set", "swarm.catchup_rounds=5"]
    others = start_swarm(nodes, 3, extra=sparse)
    others[0].wait_round(8, timeout=120)
    sleeper = nodes("n3", *COMMON, *sparse, "--bootstrap", others[0].address(),
                    env={"GONKA_TEST_HOLD_FIRST_DOWNLOAD": "3"})
    swarm = [*others, sleeper]
    wait_until(lambda: "members=4" in sleeper.log(), 200, "a 4-member round")
    joined = sleeper.log().split("members=4")[0]
    assert "holding the first state download" in joined, joined[-3000:]
    assert len(re.findall(r"downloaded round \d+ state", joined)) == 1, joined[-3000:]
    caught = re.search(r"caught up (\d+) rounds from their averages", joined)
    assert caught and int(caught.group(1)) >= 1, joined[-3000:]
    assert "trained round" not in joined.split("resynced round=")[0], joined[-3000:]
    sleeper.proc.send_signal(signal.SIGSTOP)
    # The others may not have logged that commit yet; the sleeper has.
    stopped_at = max(max(n.rounds(), default=0) for n in swarm)
    try:
        # The others carry on without it, well within the bound.
        for n in others:
            n.wait_round(stopped_at + 2, timeout=BOUND + 30)
    finally:
        sleeper.proc.send_signal(signal.SIGCONT)
    woke = len(sleeper.log())
    # It notices it was left behind, re-syncs, and trains with the swarm again.
    wait_until(lambda: re.search(r"resynced round=\d+ .*\n(.*\n)*.*committed round=\d+ .*members=4",
                                 sleeper.log()[woke:]), 120, "the sleeper to re-sync and rejoin")
    # A few rounds behind: from their averages, without downloading the state.
    assert "from the rounds' averages" in sleeper.log()[woke:], sleeper.log()[woke:][-3000:]
    stop_and_check_consistent(swarm)


def test_joiner_survives_a_donor_dying_mid_download(nodes):
    # Small pieces so each of the three donors is asked for some; one dies when asked. Rounds
    # last 15 s (30 inner steps that each wait 0.5 s, as on an accelerator) whatever the machine's
    # load (a joiner starts in ~3 s and downloads the tiny state in under 1), and the joiner
    # starts right after all three committed the same round: every donor holds the state it asks
    # for, so the one set to die is asked (not hoped to be asked) while the others still serve.
    # No averages kept: a joiner one round behind would take that round from its average
    # instead of downloading the state (node/catchup.py).
    chunk = ["--set", "swarm.state_chunk_bytes=524288", "--inner-steps", "30", "--set", "swarm.catchup_rounds=0"]
    slow = {"GONKA_TEST_STEP_SECONDS": "0.5"}
    swarm = start_swarm(nodes, 3, env_for={0: slow, 1: slow, 2: {**slow, "GONKA_TEST_FAULT": "serve@1"}}, extra=chunk)

    def same_round():
        states = [n.rounds() for n in swarm]
        common = set.intersection(*(set(r) for r in states))
        return bool(common) and len({s[max(common)] for s in states}) == 1 and \
            all(max(s) == max(common) for s in states)

    wait_until(same_round, 150, "all donors on one committed round")
    joiner = nodes("joiner", *COMMON, *chunk, "--bootstrap", swarm[0].address(), env=slow)
    assert swarm[2].wait_exit(120) == -signal.SIGKILL, swarm[2].log()[-3000:]
    assert "SIGKILL at serve" in swarm[2].log()
    wait_until(lambda: "reason=join" in joiner.log(), 120, "the joiner to finish its download")
    # The joiner asks the donors its peer table holds when it starts: all three, or (a heartbeat
    # not in yet) two, the one set to die among them since it died.
    left = re.search(r"donor \w+ failed .* (\d+) donors left", joiner.log())
    done = re.search(r"downloaded round \d+ state .* from (\d+) donors", joiner.log())
    assert left and done, joiner.log()[-3000:]
    assert int(left.group(1)) >= 1 and int(done.group(1)) == int(left.group(1)) + 1, joiner.log()[-3000:]
    first_round = max(joiner.rounds())
    joiner.wait_round(first_round + 1, timeout=120)
    stop_and_check_consistent([swarm[0], swarm[1], joiner])
