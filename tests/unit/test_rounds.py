"""Round protocol between in-process peers over real p2pd daemons on loopback."""

import asyncio
import os

import pytest
import torch

from node.metrics import NodeMetrics
from p2p.config import SwarmConfig
from p2p.codecs import get_codec
from p2p.compression import part_bounds
from p2p.group import Group
from p2p.rounds import RoundProtocol
from p2p.swarm import Swarm

pytestmark = pytest.mark.timeout(90)

FAST = dict(heartbeat_interval=0.3, gather_timeout=10, round_timeout=10, request_timeout=5)


def rejected(metrics: NodeMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("gonka_node_rejected_messages_total", {"reason": reason}) or 0.0


async def start_peers(n: int, run: str = "t", min_peers: int = 1, codec: str = "fp32"):
    peers, first = [], None
    for _ in range(n):
        cfg = SwarmConfig(bootstrap=first.maddrs if first else [], min_peers=min_peers, codec=codec, **FAST)
        metrics = NodeMetrics()
        swarm = await Swarm.start(cfg, run, identity_path=None,
                                  on_reject=lambda reason, m=metrics: m.rejected_messages.labels(reason=reason).inc())
        first = first or swarm
        rounds = RoundProtocol(swarm, metrics)
        await rounds.start()
        swarm.announce(state="training", round=0, hash="h0")
        peers.append((swarm, rounds, metrics))
    return peers


async def stop_peers(peers) -> None:
    await asyncio.gather(*(s.close() for s, _, _ in peers))


def test_part_bounds_cover_everything():
    for numel, parts in [(10, 3), (3, 5), (1000, 7)]:
        b = part_bounds(numel, parts)
        assert b[0][0] == 0 and b[-1][1] == numel
        assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
        assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


async def test_weighted_average_is_bit_identical_on_every_member():
    peers = await start_peers(3, min_peers=3)
    try:
        torch.manual_seed(0)
        inputs = [[torch.randn(300, 7), torch.randn(13)] for _ in peers]
        weights = [1.0, 2.0, 5.0]
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average(x, w, 0) for (_, r, _), x, w in zip(peers, inputs, weights))), 60)
        expected = [sum(w * x[k] for w, x in zip(weights, inputs)) / sum(weights) for k in range(2)]
        for res in results:
            assert res is not None, [r.last for _, r, _ in peers]
            for k in range(2):
                assert torch.equal(res[k], results[0][k])
                assert torch.allclose(res[k], expected[k], atol=1e-6)
        assert all(r.last.status == "committed" and len(r.last.members) == 3 for _, r, _ in peers)
    finally:
        await stop_peers(peers)


@pytest.mark.parametrize("codec", ["int8", "fp4"])
async def test_compressed_average_is_bit_identical_and_keeps_the_residual(codec):
    peers = await start_peers(3, min_peers=3, codec=codec)
    try:
        torch.manual_seed(1)
        inputs = [[torch.randn(1000)] for _ in peers]
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average(x, 1.0, 0) for (_, r, _), x in zip(peers, inputs))), 60)
        assert all(res is not None and torch.equal(res[0], results[0][0]) for res in results)
        mean = sum(x[0] for x in inputs) / 3
        error = (results[0][0] - mean).norm() / mean.norm()
        assert error < (0.02 if codec == "int8" else 0.5), error
        for (_, r, m), x in zip(peers, inputs):
            # Error feedback kept exactly what this member's encoding dropped.
            sent = x[0] - r.feedback.residual
            assert r.feedback.residual.abs().max() > 0
            assert (sent - x[0]).abs().max() <= x[0].abs().max()
            assert m.registry.get_sample_value("gonka_node_sent_bytes_total") < 1000 * 4 * 2
    finally:
        await stop_peers(peers)


async def test_stranger_and_garbage_are_refused_and_counted():
    peers = await start_peers(3)
    (a, ra, ma), (b, rb, mb), (stranger, rs, _) = peers
    try:
        # a and b form a group; the stranger tries to vote in it.
        members = sorted([a.peer_id, b.peer_id])
        group = Group(os.urandom(16), 0, members, a.peer_id, torch.zeros(8), 1.0, get_codec("fp32"))
        ra._install(group)
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

        # The attacked peer still averages normally afterwards.
        stranger.announce(state="stopped")
        await stranger.leave()
        res = await asyncio.wait_for(asyncio.gather(ra.average([torch.ones(5)], 1.0, 0),
                                                    rb.average([torch.zeros(5)], 1.0, 0)), 60)
        assert all(torch.equal(r[0], torch.full((5,), 0.5)) for r in res), (res, ra.last, rb.last)
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
