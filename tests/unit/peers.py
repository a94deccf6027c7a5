"""In-process peers of one swarm over real p2pd daemons on loopback, for the tests of the
round protocol (test_rounds.py, test_meeting.py, test_hostile*.py, test_signing.py, ...): start
and stop them, wait until they see each other, and drive their rounds as a node would."""

from __future__ import annotations

import asyncio

import torch

from node.metrics import NodeMetrics
from p2p.config import SwarmConfig
from p2p.rounds import RoundProtocol
from p2p.swarm import Swarm

FAST = dict(heartbeat_interval=0.3, gather_timeout=10, round_timeout=10, request_timeout=5)


def rejected(metrics: NodeMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("gonka_node_rejected_messages_total", {"reason": reason}) or 0.0


async def start_peers(n: int, run: str = "t", min_peers: int = 1, codec: str = "fp32", aggregator: str = "mean",
                      protocols: dict[int, type] | None = None, **settings):
    """n peers of one swarm; the plain mean unless asked, so tests can compute what they expect.
    ``protocols``: peer index -> a RoundProtocol subclass that peer runs instead."""
    peers, first = [], None
    for _ in range(n):
        cfg = SwarmConfig(bootstrap=first.maddrs if first else [], min_peers=min_peers, codec=codec,
                          aggregator=aggregator, **{**FAST, **settings})
        metrics = NodeMetrics()
        swarm = await Swarm.start(cfg, run, identity_path=None,
                                  on_reject=lambda reason, m=metrics: m.rejected_messages.labels(reason=reason).inc())
        first = first or swarm
        rounds = (protocols or {}).get(len(peers), RoundProtocol)(swarm, metrics)
        await rounds.start()
        swarm.announce(state="training", round=0, hash="h0")
        peers.append((swarm, rounds, metrics))
    return peers


async def stop_peers(peers) -> None:
    await asyncio.gather(*(s.close() for s, _, _ in peers))


def quarantined(metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("gonka_node_quarantined_total", {"reason": reason}) or 0.0


async def settle(peers) -> None:
    """Until every peer's table shows every other peer training (a round needs a majority of the
    live peers it sees; a peer's first heartbeat says it is joining)."""
    for _ in range(200):
        tables = [await s.refresh_peers() for s, _, _ in peers]
        if all(len(t) == len(peers) - 1 and all(r.state == "training" for r in t.values()) for t in tables):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the peers never saw each other")


# Heartbeats of a second (records live three): a table that loses a peer for a moment under CPU
# load makes a smaller group than the test means to make.
STEADY = dict(heartbeat_interval=1.0)


async def wait_for(predicate, timeout: float) -> None:
    """Until ``predicate()`` holds, checked every 10 ms; AssertionError after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not the case after {timeout} s: {predicate}")
        await asyncio.sleep(0.01)


async def seen_ready(peers, peer_id: str, round: int = 0) -> None:
    """Until every one of ``peers`` sees ``peer_id`` ready for ``round``."""
    for _ in range(200):
        tables = [await s.refresh_peers() for s, _, _ in peers if s.peer_id != peer_id]
        if all(peer_id in t and (t[peer_id].state, t[peer_id].round) == ("ready", round) for t in tables):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{peer_id[-8:]} never looked ready")


async def attempt(rounds_list, inputs, weight=1.0, round=0, timeout=60):
    """One average call on each of ``rounds_list``; their results (None where aborted)."""
    return await asyncio.wait_for(asyncio.gather(*(r.average([x], weight, round) for r, x in zip(rounds_list, inputs))),
                                  timeout)


async def until_committed(rounds_list, inputs, tries: int = 6, timeout: float = 90.0, round: int = 0):
    """Each of ``rounds_list`` averages until it commits, as a node does: an aborted attempt is
    tried again at once; a commit announces the next round, so a peer left out of that group
    learns it is behind instead of waiting for peers that are done. Returns each peer's result
    and how each of its attempts ended; a timeout says how each peer's last attempt ended."""
    async def one(r, x):
        outcomes = []
        for _ in range(tries):
            result = await r.average([x], 1.0, round)
            outcomes.append(r.last)
            if result is not None:
                r.swarm.announce(state="training", round=round + 1)
                return result, outcomes
            if r.last.status == "behind":
                break
        return None, outcomes

    try:
        async with asyncio.timeout(timeout):
            out = await asyncio.gather(*(one(r, x) for r, x in zip(rounds_list, inputs)))
    except TimeoutError:
        raise AssertionError(f"not every peer committed within {timeout:.0f}s: "
                             + "; ".join(f"{r.swarm.peer_id[-8:]}: {r.last}" for r in rounds_list)) from None
    return [result for result, _ in out], [n for _, n in out]


def story(outcomes) -> str:
    """Each peer's attempts, one line each: how it ended, with whom."""
    return "\n".join(" | ".join(f"{o.status}:{o.reason}:{o.group_id}:{','.join(m[-4:] for m in o.members)}"
                                f" blamed {','.join(m[-4:] for m in o.blamed)}"
                                for o in seen) for seen in outcomes)


def honest_inputs(n: int, numel: int = 4096, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=gen)
    return [base + 0.3 * torch.randn(numel, generator=gen) for _ in range(n)]


async def keep_averaging(rounds, x, at=lambda: 0):
    """A hostile member's loop: average at round ``at()`` (the honest peers' round) again and again."""
    while True:
        await rounds.average([x], 1.0, at())
        await asyncio.sleep(0.1)
