"""The simulator runs the node's round: one seed through a two-node swarm (real processes, the
real CLI) and through the in-process simulator gives the same θ, bit for bit, round by round;
plain rounds and overlapped ones (eager, landing at a fixed step)."""

import pytest
import torch

from node.config import load_config
from node.daemon import fingerprint_terms
from p2p.compression import SwarmAverage
from tests.integration.nodes import FAST
from trainer.data import open_source
from trainer.simulator import Simulator

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROUNDS, STEPS = 3, 3


def settings(args: list[str]) -> dict[str, str]:
    """The --set and flag values of ``args`` that the simulator needs, as config keys."""
    flags = {"--model": "model.source", "--seed": "node.seed", "--inner-steps": "inner.steps"}
    out, it = {}, iter(args)
    for a in it:
        if a == "--set":
            key, _, value = next(it).partition("=")
            out[key] = value
        elif a in flags:
            out[flags[a]] = next(it)
    return out


@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_two_nodes_and_the_simulator_hold_the_same_theta(nodes, overlap):
    common = ["--inner-steps", str(STEPS), "--min-peers", "2", "--max-rounds", str(ROUNDS), "--seed", "5",
              "--set", f"outer.overlap={overlap}"]
    if overlap != "off":  # where the average lands: a fixed step, as the simulator's land_after
        common += ["--set", "outer.land_step=2"]
    first = nodes("a", *common)
    second = nodes("b", *common, "--bootstrap", first.address())
    for n in (first, second):
        assert n.wait_exit(timeout=180) == 0, n.log()[-3000:]
    swarm = [first.rounds(), second.rounds()]
    assert swarm[0] == swarm[1] and set(swarm[0]) >= set(range(1, ROUNDS + 1)), swarm

    cfg = load_config(toml_path=None, environ={}, overrides=settings(FAST + common))
    # A node's data shard is keyed by its peer id; the swarm's members are in peer id order.
    keys = sorted([first.peer_id(), second.peer_id()])
    sim = Simulator(2, model=cfg.model, data=cfg.data, inner=cfg.inner, outer=cfg.outer,
                    corpus=open_source(cfg.data.paths), seed=cfg.node.seed, shard_keys=keys,
                    combine=SwarmAverage(cfg.swarm.aggregator), threads=1,
                    land_after=(cfg.outer.land_step - 1) / STEPS if overlap != "off" else 1.0)
    # A node's batches of a round follow from its run's fingerprint (trainer/data.py): the
    # simulator's workers draw by the same key, the one the nodes logged.
    run_key = sim.workers[0].fingerprint(*fingerprint_terms(cfg)).digest
    assert f"run fingerprint {run_key[:16]}" in first.log()
    sim.assign_data(run_key)
    threads = torch.get_num_threads()
    try:
        records = sim.run_sync(ROUNDS, STEPS)
    finally:
        torch.set_num_threads(threads)
    # Overlapped, record n holds θ of round n (the average of round n+1 still travelling).
    lag = 0 if overlap == "off" else 1
    for record in records:
        assert all(record["committed"]) and len(set(record["hashes"])) == 1
        if record["round"] > 0:
            assert record["hashes"][0] == swarm[0][record["round"]], (record["round"], swarm[0])
    assert records[-1]["round"] == ROUNDS - lag
    assert [w.params_hash() for w in sim.workers] == [swarm[0][ROUNDS]] * 2
