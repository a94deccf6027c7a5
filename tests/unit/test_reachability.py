"""Whether peers can dial this node: the decision, the addresses dialled, and the check between
in-process peers over real p2pd daemons on loopback."""

import asyncio
import socket

import pytest

from p2p.reachability import MAX_ADDRESSES, tcp_endpoints, verdict
from tests.unit.peers import start_peers, stop_peers

pytestmark = pytest.mark.timeout(60)


def test_only_tcp_addresses_of_ip_literals_are_dialled_at_most_four():
    maddrs = ["/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWabc", "/ip4/10.0.0.1/tcp/31337", "/ip6/::1/tcp/4001",
              "/dns4/example.org/tcp/1", "/ip4/10.0.0.2/udp/9/quic", "/ip4/999.1.1.1/tcp/5", "/ip4/10.0.0.3/tcp/0",
              "/ip4/10.0.0.4/tcp/70000", 17, "/ip4/10.0.0.5/tcp/1", "/ip4/10.0.0.6/tcp/2", "/ip4/10.0.0.7/tcp/3"]
    assert tcp_endpoints(maddrs) == [("10.0.0.1", 31337), ("::1", 4001), ("10.0.0.5", 1), ("10.0.0.6", 2)]
    assert len(tcp_endpoints([f"/ip4/10.0.0.{i}/tcp/1" for i in range(10)])) == MAX_ADDRESSES


def test_a_strict_majority_of_answers_decides_and_none_is_unknown():
    assert verdict([]) is None
    assert verdict([True]) is True and verdict([False]) is False
    assert verdict([True, False]) is False  # a tie is no proof
    assert verdict([True, True, False]) is True


def closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there now
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def announce(swarm, maddrs: list[str], others) -> None:
    """``swarm`` announces ``maddrs``; returns once ``others`` hold them in their tables."""
    swarm.maddrs = maddrs
    swarm.announce(step=1)
    async with asyncio.timeout(30):
        while any(s.peers[swarm.peer_id].maddrs != tuple(maddrs) for s in others):
            await asyncio.gather(*(s.refresh_peers() for s in others))
            await asyncio.sleep(0.1)


async def test_peers_dial_back_what_a_node_announces():
    peers = await start_peers(3)
    try:
        (a, ra, _), (b, rb, _), (c, rc, _) = peers
        async with asyncio.timeout(30):
            while min([len(await s.refresh_peers()) for s, _, _ in peers]) < 2:
                await asyncio.sleep(0.1)
        assert await ra.reachability.check() is True
        # c announces an address nothing listens on (what a peer behind NAT announces, in effect).
        listening = list(c.maddrs)
        await announce(c, [f"/ip4/127.0.0.1/tcp/{closed_port()}"], (a, b))
        assert await rc.reachability.check() is False
        # Asked again at once, a peer does not dial the same addresses again: no answer, so the
        # verdict stands.
        assert await rc.reachability.check() is False
        # New addresses (a peer restarted on another port, same identity) are dialled at once.
        await announce(c, listening, (a, b))
        assert await rc.reachability.check() is True
    finally:
        await stop_peers(peers)


class _Table:
    """What ``Reachability.run`` reads of a swarm: its peers, and what it announces."""

    def __init__(self) -> None:
        self.peers = {}
        self.peer_id = "me"
        self.announced = []

    def announce(self, **fields) -> None:
        self.announced.append(fields)


async def test_run_checks_once_peers_show_and_behind_nat_keeps_dialling_out(monkeypatch):
    from p2p import reachability as module

    swarm = _Table()
    answers = iter([None, False])  # nobody answers at first; then the peers say they could not dial us
    reach = module.Reachability(swarm, call=None, request_timeout=1.0)
    checked, dialled, changes = [], asyncio.Event(), []

    async def check():
        checked.append(len(swarm.peers))
        reach.reachable = next(answers, reach.reachable)
        return reach.reachable

    async def stay_connected():
        dialled.set()
        return 1

    monkeypatch.setattr(reach, "check", check)
    monkeypatch.setattr(reach, "stay_connected", stay_connected)
    task = asyncio.create_task(reach.run(0.01, changes.append))
    try:
        await asyncio.sleep(0.05)
        assert reach.checking and checked == []  # alone: nobody to ask
        swarm.peers["other"] = object()
        await asyncio.wait_for(dialled.wait(), 10)  # unknown, asked again 3 heartbeats later: NAT'd
        assert checked == [1, 1] and changes == [False]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
