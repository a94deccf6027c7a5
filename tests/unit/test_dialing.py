"""How this node's p2pd dials other peers: from an ephemeral port, and from the addresses a peer's
signed heartbeat gives (real p2pd daemons on loopback)."""

import asyncio
import os

import pytest

from node.metrics import NodeMetrics
from p2p.config import SwarmConfig
from p2p.swarm import Swarm

pytestmark = pytest.mark.timeout(60)

FAST = dict(heartbeat_interval=0.3, gather_timeout=10, round_timeout=10, request_timeout=5)


async def start(bootstrap: list[str]) -> Swarm:
    metrics = NodeMetrics()
    swarm = await Swarm.start(SwarmConfig(bootstrap=bootstrap, **FAST), "dial", identity_path=None,
                              on_reject=lambda reason: metrics.rejected_messages.labels(reason=reason).inc())
    swarm.announce(state="training", round=0, hash="h0")
    return swarm


def tcp_port(maddr: str) -> int:
    return int(maddr.split("/tcp/", 1)[1].split("/", 1)[0])


def established(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of every established TCP connection process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    with open(f"/proc/{pid}/net/tcp") as table:
        for line in table.readlines()[1:]:
            cols = line.split()
            if cols[3] == "01" and cols[9] in inodes:  # 01: ESTABLISHED
                found.append((int(cols[1].split(":")[1], 16), int(cols[2].split(":")[1], 16)))
    return found


async def test_a_peer_met_through_the_dht_is_dialled_from_its_heartbeat_from_an_ephemeral_port():
    # c knows only a; it meets b through the DHT, so its p2pd has no address of b's and must be
    # given the ones b's signed heartbeat lists (which end in /p2p/<b's id>).
    a = await start([])
    b = c = None
    try:
        b = await start(a.maddrs)
        c = await start(a.maddrs)
        async with asyncio.timeout(30):
            while b.peer_id not in await c.refresh_peers():
                await asyncio.sleep(0.1)
        assert await c.connect_to(b.peer_id)
        b_port, c_port = tcp_port(b.maddrs[0]), tcp_port(c.maddrs[0])
        to_b = [local for local, remote in established(c.p2pd_pid) if remote == b_port]
        assert to_b, established(c.p2pd_pid)
        # Not from c's listen port: two peers dialling each other at once would otherwise send
        # SYNs of one 4-tuple, which TCP merges into a simultaneous open that libp2p cannot use.
        assert c_port not in to_b, (c_port, to_b)
    finally:
        await asyncio.gather(*(s.close() for s in (a, b, c) if s is not None))


async def test_a_peers_round_trip_time_is_the_least_of_its_recent_prompt_calls():
    # Two peers on loopback: a prompt request's call is a round trip; an answer held back by the
    # far end (or a request that is not prompt) does not raise the estimate.
    from p2p.rounds import RoundProtocol
    from p2p.shard import RTT_SAMPLES

    a = await start([])
    b = None
    try:
        b = await start(a.maddrs)
        ra, rb = RoundProtocol(a, NodeMetrics()), RoundProtocol(b, NodeMetrics())
        await ra.start()
        await rb.start()
        assert ra.dial.rtt(b.peer_id) is None
        for _ in range(3):
            await ra.dial.call(b.peer_id, "ready", {"r": 0, "h": ""})
        first = ra.dial.rtt(b.peer_id)
        assert 0 < first < 1.0
        ra.dial._rtts[b.peer_id].append(5.0)  # one slow answer among them: the least still stands
        assert ra.dial.rtt(b.peer_id) == first
        for _ in range(RTT_SAMPLES):  # only the last RTT_SAMPLES calls count
            await ra.dial.call(b.peer_id, "ready", {"r": 0, "h": ""})
        assert len(ra.dial._rtts[b.peer_id]) == RTT_SAMPLES and max(ra.dial._rtts[b.peer_id]) < 5.0
    finally:
        await asyncio.gather(*(s.close() for s in (a, b) if s is not None))
