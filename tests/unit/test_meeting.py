"""How in-process peers over real p2pd daemons on loopback meet for a round: peer tables that a
short lookup or a pause leaves wrong, ready hints, members that cannot dial each other, and
strangers and garbage on the round's streams. What the round computes: test_rounds.py."""

import asyncio
import os

import pytest
import torch

import p2p.formation
from p2p import gathering
from p2p.codecs import get_codec
from p2p.group import Group
from p2p.wire import WireError
from tests.unit.peers import rejected, start_peers, stop_peers

pytestmark = pytest.mark.timeout(90)


async def test_stranger_and_garbage_are_refused_and_counted():
    # min_peers=2: a and b must average together at the end. With 1, a peer whose table missed
    # the other's heartbeat (0.9 s TTL at these timings) may commit alone: seen once in CI, under load.
    peers = await start_peers(3, min_peers=2)
    (a, ra, ma), (b, rb, mb), (stranger, rs, _) = peers
    try:
        # a and b form a group; the stranger tries to vote in it.
        members = sorted([a.peer_id, b.peer_id])
        group = Group(os.urandom(16), 0, members, a.peer_id, torch.zeros(8), 1.0, get_codec("fp32"))
        ra.plane.install(group)
        reply, _ = await rs._call(a.peer_id, "vote", {"g": group.id, "digest": b"x" * 16})
        assert reply == {"ok": False, "reason": "not_a_member"}
        assert rejected(ma, "not_a_member") == 1
        assert group.votes == {}
        ra._group = None

        # Raw garbage on the round protocol's stream: rejected, counted, node unharmed.
        _, reader, writer = await rs._open(a.peer_id, "part")
        writer.write(b"\xff" * 8 + b"junk")
        await writer.drain()
        writer.close()
        for _ in range(50):
            if rejected(ma, "oversized_header"):
                break
            await asyncio.sleep(0.1)
        assert rejected(ma, "oversized_header") == 1

        # A ready hint that is not one: refused and counted.
        with pytest.raises(WireError):  # no answer: the stream is closed on it
            await rs._call(a.peer_id, "ready", {"r": "soon"})
        assert rejected(ma, "bad_field") == 1

        # The attacked peer still averages normally afterwards.
        stranger.announce(state="stopped")
        await stranger.leave()
        res = await asyncio.wait_for(asyncio.gather(ra.average([torch.ones(5)], 1.0, 0),
                                                    rb.average([torch.zeros(5)], 1.0, 0)), 60)
        assert all(torch.equal(r[0], torch.full((5,), 0.5)) for r in res), (res, ra.last, rb.last)
    finally:
        await stop_peers(peers)


async def test_a_short_lookup_keeps_the_records_found_before_until_they_expire():
    # A DHT lookup can come back without a record that is still in the DHT (a node that did
    # not answer in time); a node that took that for the truth saw itself alone and led alone.
    peers = await start_peers(2, heartbeat_interval=1.0)
    try:
        (a, _, _), (b, _, _) = peers
        async with asyncio.timeout(30):
            while b.peer_id not in await a.refresh_peers():
                await asyncio.sleep(0.1)
        b._heartbeat_task.cancel()  # b goes silent: its last record lives for 3 heartbeats at most
        await asyncio.gather(b._heartbeat_task, return_exceptions=True)

        async def found_nothing(key, latest=False):
            return None

        a.dht.get = found_nothing
        assert b.peer_id in await a.refresh_peers() and a.table_fresh
        async with asyncio.timeout(30):  # and gone once that record expires
            while b.peer_id in await a.refresh_peers():
                await asyncio.sleep(0.1)
    finally:
        await stop_peers(peers)


async def test_peers_that_forgot_each_other_find_the_swarm_again():
    # What a SIGSTOP does: the paused peer's DHT requests all time out when it resumes, and
    # the others dropped it while it was silent; hivemind removes a peer from the routing
    # table at its first missed reply, so both sides forget each other and nobody calls.
    peers = await start_peers(3)
    try:
        (a, _, _), (b, _, _), (c, _, _) = peers
        async with asyncio.timeout(30):
            while len(await a.refresh_peers()) < 2:
                await asyncio.sleep(0.1)
        a._heartbeat_task.cancel()  # a stays silent, as a paused node is
        await asyncio.gather(a._heartbeat_task, return_exceptions=True)
        for me, others in ((a, (b, c)), (b, (a,)), (c, (a,))):
            table = me.dht.protocol.routing_table
            for o in others:
                if table.get(peer_id=o.p2p.peer_id) is not None:
                    del table[table.get(peer_id=o.p2p.peer_id)]
        b.announce(step=101)
        c.announce(step=102)
        # a's lookups find only what it still holds; once that expires it must call the
        # peers it knew, and then read their fresh heartbeats.
        async with asyncio.timeout(30):
            while {p: r.inner_step for p, r in (await a.refresh_peers()).items()} != {b.peer_id: 101, c.peer_id: 102}:
                await asyncio.sleep(0.1)
        assert a.peer_id in {str(p) for p in b.dht.protocol.routing_table.peer_id_to_uid}
    finally:
        await stop_peers(peers)


async def test_a_ready_hint_starts_the_round_before_the_leaders_next_poll(monkeypatch):
    # The leader polls the peer table every POLL_SECONDS; the others tell it directly that
    # they are ready, so it starts the round as soon as the last of them is.
    monkeypatch.setattr(p2p.formation, "POLL_SECONDS", 20.0)
    peers = sorted(await start_peers(3, min_peers=3), key=lambda p: p[0].peer_id)
    try:
        for swarm, _, _ in peers:
            await swarm.refresh_peers()
        (_, leader, _), *others = peers
        leading = asyncio.ensure_future(leader.average([torch.ones(4)], 1.0, 0))
        for _ in range(100):  # the leader has read the table: the others are still training
            if leader.formation.waiting is not None and leader.swarm.peers:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        results = await asyncio.wait_for(asyncio.gather(leading, *(r.average([torch.zeros(4)], 1.0, 0)
                                                                   for _, r, _ in others)), 15)
        assert all(torch.equal(res[0], torch.full((4,), 1 / 3)) for res in results)
        assert leader.last.status == "committed" and len(leader.last.members) == 3
        assert leader.last.gather_seconds < 10, leader.last  # not a poll interval
    finally:
        await stop_peers(peers)


async def test_a_ready_hint_counts_for_one_attempt_only():
    # A member that refused (it was between attempts) must say it is ready again before
    # the leader counts it: otherwise leader and members can miss each other forever.
    peers = sorted(await start_peers(2, min_peers=2), key=lambda p: p[0].peer_id)
    (a, ra, _), (b, rb, _) = peers
    try:
        await a.refresh_peers()
        ra.formation.hints[b.peer_id] = 0
        ra.formation.waiting = p2p.formation.Wait(0, torch.zeros(4), 1.0, asyncio.get_running_loop().create_future())
        assert await ra.formation.lead(0, sorted([a.peer_id, b.peer_id])) is None  # b is not waiting: it refuses
        assert b.peer_id not in ra.formation.hints
        ra.formation.waiting = None
        # Both enter the round: b hints again, and the round commits.
        res = await asyncio.wait_for(asyncio.gather(ra.average([torch.ones(3)], 1.0, 0),
                                                    rb.average([torch.zeros(3)], 1.0, 0)), 30)
        assert all(r is not None and torch.equal(r[0], torch.full((3,), 0.5)) for r in res)
    finally:
        await stop_peers(peers)


async def test_members_that_cannot_dial_each_other_own_no_part_and_never_meet():
    # Peers 2 and 3 stand for hosts behind two NATs: neither can open a stream to the other.
    # The two peers whose heartbeats say they accept dials own the parts; the others only dial
    # them, and the round commits with all four, bit-identical, without a stream between the two.
    peers = await start_peers(4, min_peers=4)
    by_id = {s.peer_id: i for i, (s, _, _) in enumerate(peers)}
    nat = {peers[2][0].peer_id, peers[3][0].peer_id}
    tried: list[tuple[str, str]] = []
    for swarm, _, _ in peers[2:]:
        opened = swarm.p2p.call_binary_stream_handler

        async def guarded(peer_id, name, me=swarm.peer_id, opened=opened):
            if peer_id.to_base58() in nat:
                tried.append((me, peer_id.to_base58(), name))
                raise ConnectionError("no route through the NAT")
            return await opened(peer_id, name)

        swarm.p2p.call_binary_stream_handler = guarded
    try:
        for swarm, rounds, _ in peers[:2]:
            rounds.reachability.reachable = True
            swarm.announce(dial=True)

        async def seen() -> None:
            while True:
                tables = [await s.refresh_peers() for s, _, _ in peers]
                if all(sum(1 for p, r in t.items() if r.reachable) == (2 if s.peer_id in nat else 1)
                       for t, (s, _, _) in zip(tables, peers)):
                    return
                await asyncio.sleep(0.2)

        await asyncio.wait_for(seen(), 20)
        torch.manual_seed(5)
        inputs = [[torch.randn(1000), torch.randn(37)] for _ in peers]
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average(x, 1.0, 0) for (_, r, _), x in zip(peers, inputs))), 60)
        assert all(r.last.status == "committed" and len(r.last.members) == 4 for _, r, _ in peers), \
            [r.last for _, r, _ in peers]
        for k in range(2):
            expected = sum(x[k] for x in inputs) / 4
            assert all(torch.equal(res[k], results[0][k]) for res in results)
            assert torch.allclose(results[0][k], expected, atol=1e-6)
        assert tried == [], [(by_id[a], by_id[b], name) for a, b, name in tried]
        # Every round in the table's view: the owners were the two dialable peers.
        owners = sorted(s.peer_id for s, _, _ in peers[:2])
        assert all(gathering.owners([s.peer_id for s, _, _ in peers], r.swarm.peers, r.swarm.peer_id,
                                    r.reachability.reachable is True) == owners for _, r, _ in peers)
        assert all(r.last.owners == owners for _, r, _ in peers)
    finally:
        await stop_peers(peers)
