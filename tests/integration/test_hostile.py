"""Lies and splits in real swarms on loopback, through the real CLI: no split brain when a
member dies on a loaded machine, and no state adopted on the word of a minority of liars.

Hostile nodes are real nodes started with GONKA_TEST_HOSTILE (p2p/hostile.py). Every test
ends asserting that the honest peers hold one params_hash and adopted nothing hostile."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.nodes import check_recovered

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

MEMBERS = re.compile(r"committed round=(\d+) hash=([0-9a-f]+) members=(\d+)")


def commits(node) -> list[tuple[int, str, int]]:
    """(round, params_hash, members) of every round the node committed itself."""
    return [(int(r), h, int(m)) for r, h, m in MEMBERS.findall(node.log())]


@pytest.fixture
def cpu_load():
    """Another CPU-bound job on the machine, as CI may have: a busy process, with the 4 nodes on
    2 cores (and in ./scripts/test the suite's other pytest processes beside them); started by
    the test (``cpu_load()``) once every node has started, so that it loads the rounds, not the
    nodes' imports."""
    burners = []

    def start():
        burners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))

    yield start
    for burner in burners:
        burner.kill()
        burner.wait(10)


def test_a_killed_member_never_splits_the_survivors_under_cpu_load(nodes, cpu_load):
    # Issue 14's split brain: 4 peers with default settings (no --min-peers), one SIGKILLed
    # mid-round; each survivor committed the next round alone. A round must have a strict
    # majority of the live peers: 3 of 4 while the dead one still heartbeats, 2 of 3 after.
    common = ["--inner-steps", "8"]
    first = nodes("n0", *common)
    addr = first.address()
    swarm = [first, *(nodes(f"n{i}", *common, "--bootstrap", addr,
                            env={"GONKA_TEST_FAULT": "reduce@2:4"} if i == 3 else None) for i in range(1, 4))]
    victim, survivors = swarm[3], swarm[:3]
    for n in swarm:  # started: each listens once its model is built; the round of four comes after
        n.address()
    cpu_load()
    assert victim.wait_exit(240) == -signal.SIGKILL, victim.log()[-3000:]
    died = time.time()
    fault_round = int(re.search(r"SIGKILL at \w+ of round (\d+)", victim.log()).group(1))
    for n in survivors:
        n.wait_round(fault_round + 1, timeout=240)
    # The attempt it died in aborted, and the survivors committed again within the documented
    # bound (tests/integration/test_faults.py kills one in every other phase).
    assert any(f"aborted round={fault_round}" in n.log() for n in survivors)
    check_recovered(survivors, fault_round, died)
    for n in survivors:
        n.proc.send_signal(signal.SIGTERM)
    for n in survivors:
        assert n.wait_exit(60) == 0, n.log()[-3000:]
    by_round: dict[int, set[str]] = {}
    who: dict[int, list] = {}
    for n in survivors:
        for rnd, params_hash, members in commits(n):
            # Before the others started, the first node trained alone; a round it committed alone
            # while they were still joining from its older state is thrown away when it follows
            # their majority (docs/faults.md, "Known limit: a lone node and its joiners"). From the
            # kill on: no minority, no split.
            if rnd < fault_round:
                continue
            assert members >= 2, (n.name, rnd, members)  # never a minority of 3 (or 4) live peers
            by_round.setdefault(rnd, set()).add(params_hash)
            who.setdefault(rnd, []).append((n.name, params_hash[:8], members))
    # The honest aborts the death set off (on the dead one, then maybe a group called off because
    # a member was not waiting yet) each named whom they failed on: nobody quarantined a survivor.
    ids = {n.peer_id()[-8:] for n in survivors}
    assert not any(n.quarantined() & ids for n in survivors), [(n.name, n.quarantined()) for n in survivors]
    split = {rnd: who[rnd] for rnd, hashes in by_round.items() if len(hashes) > 1}
    assert not split, (fault_round, split, [n.log()[-4000:] for n in survivors])
    last = min(max(n.rounds()) for n in survivors)
    assert len({n.rounds()[last] for n in survivors}) == 1


def test_a_minority_announcing_a_far_newer_state_is_not_followed(nodes):
    # Issue 14: one peer announced a far newer round with a state of its own (all zeros) and
    # served it with a matching hash; every honest peer adopted it. Here two of five do it
    # (a sub-quorum; the second announces another state every round), and a joiner that knows
    # only a liar's address joins through it.
    common = ["--inner-steps", "6", "--min-peers", "2"]
    first = nodes("honest0", *common)
    addr = first.address()
    honest = [first, *(nodes(f"honest{i}", *common, "--bootstrap", addr) for i in (1, 2))]
    liars = [nodes(f"liar{i}", *common, "--bootstrap", addr, env={"GONKA_TEST_HOSTILE": kind})
             for i, kind in enumerate(("fake_state", "fake_states"))]
    for n in honest:
        n.wait_round(2, timeout=240)
    joiner = nodes("joiner", *common, "--bootstrap", liars[0].address())
    joiner.wait_round(3, timeout=240)
    for n in honest + [joiner]:
        n.wait_round(4, timeout=240)
        assert max(n.rounds()) < 1000, n.name  # the liars' round 1000+ state was never adopted
    assert not re.search(r"resynced round=1\d\d\d", joiner.log())
    for n in honest + [joiner]:
        n.proc.send_signal(signal.SIGTERM)
    for n in honest + [joiner]:
        assert n.wait_exit(60) == 0, n.log()[-3000:]
    last = min(max(n.rounds()) for n in honest + [joiner])
    assert len({n.rounds()[last] for n in honest + [joiner] if last in n.rounds()}) == 1


def test_a_free_rider_earns_nothing_is_left_out_and_the_ledger_verifies(nodes, tmp_path):
    # Issue 35: a member that sends zeros with an honest token claim was averaged in and credited
    # like the others. Now the ledger entry of its first round flags it; it counts a quarter in
    # the next and is left out after; an honest peer's ledger file verifies and credits it 0.
    common = ["--inner-steps", "6", "--min-peers", "3"]
    ckpt = {name: tmp_path / f"ckpt-{name}" for name in ("honest0", "honest1", "honest2", "rider")}
    first = nodes("honest0", *common, "--checkpoint-dir", str(ckpt["honest0"]))
    addr = first.address()
    honest = [first, *(nodes(f"honest{i}", *common, "--checkpoint-dir", str(ckpt[f"honest{i}"]), "--bootstrap", addr)
                       for i in (1, 2))]
    rider = nodes("rider", *common, "--checkpoint-dir", str(ckpt["rider"]), "--bootstrap", addr,
                  env={"GONKA_TEST_HOSTILE": "free_ride"})
    rider.address()  # up: its peer id is in its log
    rider_id = rider.peer_id()
    wait = re.compile(r"ledger round=(\d+) .*flagged .*" + re.escape(rider_id[-8:]) + ":zero")
    deadline = time.monotonic() + 240
    while len(wait.findall(first.log())) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    flagged = sorted(int(r) for r in wait.findall(first.log()))
    assert len(flagged) >= 2, first.log()[-3000:]
    for n in honest:
        n.wait_round(flagged[1] + 3, timeout=240)
    for n in honest + [rider]:
        n.proc.send_signal(signal.SIGTERM)
    for n in honest + [rider]:
        assert n.wait_exit(60) == 0, n.log()[-3000:]
    ledger = ckpt["honest0"] / "ledger.jsonl"
    cli = [sys.executable, "-m", "node.cli", "ledger"]
    verified = subprocess.run([*cli, "verify", str(ledger)], capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0, verified.stderr
    out = subprocess.run([*cli, "--checkpoint-dir", str(ckpt["honest0"]), "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    peers = json.loads(out.stdout)["peers"]
    assert peers[rider_id]["credit"] == 0.0 and peers[rider_id]["flags"]["zero"] == peers[rider_id]["rounds"]
    for n in honest:
        n.address()
        assert peers[n.peer_id()]["flagged"] == 0 and peers[n.peer_id()]["credit"] > 0, peers
    # Left out: in no entry from the second round after its second flag (a round's standing counts
    # the entries up to the state it starts from).
    members = {int(r): int(m) for r, m in re.findall(r"committed round=(\d+) hash=\w+ members=(\d+)", first.log())}
    later = [r for r in members if r > flagged[1]]
    assert later and all(members[r] == 3 for r in later), members
