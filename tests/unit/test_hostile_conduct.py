"""Hostile members over rounds, and on the streams: real swarms of this process (p2pd, DHT,
streams). A member that spoils attempts, a leader that stays silent or that most peers
quarantined, a flood of streams, malformed requests, an outsider of a closed swarm: the honest
peers strike, quarantine and refuse it, tell each other, and go on committing without it."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import torch

from p2p.hostile import Behaviour
from p2p.wire import write_frame
from tests.unit.peers import (FAST, honest_inputs, keep_averaging, quarantined, rejected, seen_ready, settle,
                              start_peers, stop_peers, STEADY, story, until_committed)

# One event loop for the module: the swarms that several tests share (module fixtures) live in it.
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


def _spoiled_enough(outcomes, aborter: str) -> bool:
    """Whether ``aborter`` spoiled three of these attempts, or two in a row."""
    spoiled, last = 0, False
    for o in outcomes:
        if o.status not in ("aborted", "committed"):
            continue  # no attempt of ours ended there (we were behind)
        now = aborter in o.blamed
        spoiled += now
        if spoiled >= 3 or (now and last):
            return True
        last = now
    return False


async def test_a_member_that_always_aborts_is_quarantined_after_two_in_a_row_or_three_strikes():
    peers = await start_peers(4, min_peers=3, **STEADY)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        aborter = peers[3][0].peer_id
        rounds[3].hostile = Behaviour(abort=True)
        inputs = honest_inputs(4, 256)
        honest = rounds[:3]
        current = [0]
        task = asyncio.ensure_future(keep_averaging(rounds[3], inputs[3], lambda: current[0]))
        seen = [[] for _ in honest]
        for round in range(3):
            current[0] = round
            await seen_ready(peers, aborter, round)  # so that the round's first group has it
            results, outcomes = await until_committed(honest, inputs[:3], round=round)
            assert all(torch.equal(res[0], results[0][0]) for res in results)
            assert all(aborter not in r.last.members for r in honest)
            for mine, more in zip(seen, outcomes):
                mine.extend(more)
        # Each abort it started was a strike wherever it landed; three quarantine it, and so do two
        # in a row: the attempts of a peer that it spoiled one after the other, no commit between.
        # (A peer may be in more groups with it than that, led by one that has not quarantined it
        # yet, or in fewer, when the others formed a group without it while it was busy in another.)
        for r, mine in zip(honest, seen):
            assert (r.conduct.quarantine.quarantined(aborter, time.monotonic())
                    == _spoiled_enough(mine, aborter)), story(seen)
        assert any(r.conduct.quarantine.quarantined(aborter, time.monotonic()) for r in honest), story(seen)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await stop_peers(peers)


async def test_a_leader_most_peers_quarantined_is_refused_by_the_rest_on_their_word():
    # x (the smallest id: it leads whenever it is ready) lied to a and b, not to c. a and b
    # refuse its groups and tell c; with 2 of 4 refusing it, x can never lead a quorum, so c
    # stops joining its groups instead of spoiling attempt after attempt.
    peers = sorted(await start_peers(4, min_peers=3, **STEADY), key=lambda p: p[0].peer_id)
    try:
        await settle(peers)
        (xs, x, _), (_, a, _), (_, b, _), (cs, c, _) = peers
        for r in (a, b):
            r.conduct.quarantine.offence(xs.peer_id, "bad_weight", time.monotonic())
        inputs = honest_inputs(4, 256)
        current = [0]
        task = asyncio.ensure_future(keep_averaging(x, inputs[0], lambda: current[0]))
        told = sorted([a.swarm.peer_id, b.swarm.peer_id])

        async def c_heard_both() -> bool:  # the word goes out in the background, after the refusal
            for _ in range(100):
                if sorted(c.conduct.refusals.refusers(xs.peer_id, time.monotonic())) == told:
                    return True
                await asyncio.sleep(0.1)
            return False

        # a and b hear x's begin (and refuse it, telling its members) if x sees them ready before
        # they commit, which a loaded machine can delay past a round: a round more, at most two.
        for round in range(3):
            await seen_ready(peers, xs.peer_id, round)
            results, outcomes = await until_committed([a, b, c], inputs[1:], round=round)
            assert all(res is not None for res in results) and all(xs.peer_id not in r.last.members for r in (a, b, c))
            current[0] = round + 1
            if await c_heard_both():
                break
        # c heard it from both; one is not enough to refuse on (a quorum of 3 of 4 is left).
        refusers = c.conduct.refusals.refusers(xs.peer_id, time.monotonic())
        assert sorted(refusers) == told, story(outcomes)
        from p2p.quorum import live_peers, shunned
        live = live_peers(cs.peers, cs.peer_id)
        assert shunned(refusers, live) and not shunned(refusers[:1], live)
        assert not c.conduct.quarantine.quarantined(xs.peer_id, time.monotonic())  # refused, not judged
        # The next round: c refuses x's groups from the start, so every honest peer commits at once
        # (x, quarantined by two and shunned by the third, leads nothing).
        await seen_ready(peers, xs.peer_id, round + 1)
        results, outcomes = await until_committed([a, b, c], inputs[1:], round=round + 1)
        assert all(len(mine) == 1 and mine[0].status == "committed" for mine in outcomes), story(outcomes)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await stop_peers(peers)


async def test_a_peer_that_quarantines_tells_every_live_peer_and_a_shunned_one_is_not_waited_for():
    # a and b quarantine x (a lie each saw); they tell every live peer at once, not only the
    # members of x's next group (those would accept its begin before hearing it). c, told by
    # both, neither joins x's groups nor waits for x to lead, although it judged nothing itself.
    peers = sorted(await start_peers(4, min_peers=3, **STEADY), key=lambda p: p[0].peer_id)
    try:
        await settle(peers)
        (xs, _, _), (_, a, _), (_, b, _), (cs, c, _) = peers
        assert xs.peer_id in c.conduct.grouping(cs.peers)
        a.conduct.offence(xs.peer_id, "bad_weight")
        b.conduct.offence(xs.peer_id, "bad_weight")
        for _ in range(600):
            if len(c.conduct.refusals.refusers(xs.peer_id, time.monotonic())) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(c.conduct.refusals.refusers(xs.peer_id, time.monotonic())) == sorted([a.swarm.peer_id,
                                                                                             b.swarm.peer_id])
        # Shunned once c's own table shows the refusers live (a short lookup may miss one a moment).
        for _ in range(200):
            if xs.peer_id not in c.conduct.grouping(await cs.refresh_peers()):
                break
            await asyncio.sleep(0.05)
        assert xs.peer_id not in c.conduct.grouping(cs.peers)
        assert not c.conduct.quarantine.quarantined(xs.peer_id, time.monotonic())
        a.conduct.offence(xs.peer_id, "bad_weight")  # already quarantined: nobody is told twice
        assert len(a._background_tasks) <= 2
    finally:
        await stop_peers(peers)


@pytest_asyncio.fixture(scope="class", loop_scope="module")
async def two():
    """2 peers, shared by the tests that each send one peer something on one stream and read
    what the other counted (each counter is read as a difference, the peers live on)."""
    peers = await start_peers(2, request_timeout=5.0)
    try:
        yield peers
    finally:
        await stop_peers(peers)


class TestOneStream:  # one swarm for the class, gone after its last test
    async def test_an_abort_of_an_attempt_that_ended_is_answered_at_once(self, two):
        # Every member passes an abort on to every other; one that has left the attempt answers at
        # once instead of holding the sender for a request timeout (it waited for a begin to come).
        (a, ra, ma), (_, rb, _) = two
        gid = b"\x01" * 16
        ra.plane._ended[gid] = True
        unknown = rejected(ma, "unknown_group")
        _, reader, writer = await rb._open(a.peer_id, "vote")
        await write_frame(writer, {"g": gid, "abort": "timeout"})
        from p2p.wire import read_frame
        answer, _ = await read_frame(reader, 5.0)
        assert answer == {"ok": True}  # not a stream closed after the request timeout
        assert rejected(ma, "unknown_group") == unknown
        writer.close()

    @pytest.mark.parametrize("header", [{"leader": "self"}, {"leader": 7}, {"leader": "x" * 129}, {}],
                             ids=["itself", "not-a-string", "oversized", "missing"])
    async def test_a_malformed_refusal_is_rejected_and_recorded_nowhere(self, header, two):
        (a, ra, ma), (b, rb, _) = two
        if header.get("leader") == "self":
            header = {"leader": b.peer_id}  # a peer cannot refuse itself into a shun
        before = rejected(ma, "bad_field")
        _, reader, writer = await rb._open(a.peer_id, "refuse")
        await write_frame(writer, header)
        for _ in range(100):
            if rejected(ma, "bad_field") > before:
                break
            await asyncio.sleep(0.05)
        assert rejected(ma, "bad_field") == before + 1
        assert ra.conduct.refusals.refusers(str(header.get("leader")), time.monotonic()) == []
        writer.close()

    async def test_an_oversized_declared_frame_is_refused_before_any_payload_arrives(self, two):
        (a, _, ma), (_, rb, _) = two
        before = rejected(ma, "oversized_payload")
        _, reader, writer = await rb._open(a.peer_id, "vote")
        writer.write((4).to_bytes(4, "big") + (64 << 20).to_bytes(4, "big"))  # a 4-byte header, 64 MiB payload
        await writer.drain()
        for _ in range(100):
            if rejected(ma, "oversized_payload") > before:
                break
            await asyncio.sleep(0.05)
        assert rejected(ma, "oversized_payload") == before + 1
        assert await asyncio.wait_for(reader.read(), 10) == b""  # and the stream is closed on us
        writer.close()


async def test_a_leader_that_never_sends_begin_is_left_out_and_the_others_commit():
    peers = sorted(await start_peers(3, gather_timeout=1.0, request_timeout=2.0, **STEADY), key=lambda p: p[0].peer_id)
    try:
        rounds = [r for _, r, _ in peers]
        for r in rounds:  # the others wait the silent leader out (gather_timeout + 2 request timeouts): 3 s
            r.formation.request_timeout = 1.0
        await settle(peers)
        leader = peers[0][0].peer_id  # the smallest id leads
        rounds[0].hostile = Behaviour(silent_leader=True)
        inputs = honest_inputs(3, 256)
        task = asyncio.ensure_future(rounds[0].average([inputs[0]], 1.0, 0))
        await seen_ready(peers[1:], leader)  # else they may start without it, seeing it still training
        started = time.monotonic()
        results, _ = await until_committed(rounds[1:], inputs[1:])
        assert all(res is not None for res in results) and torch.equal(results[0][0], results[1][0])
        assert all(leader not in r.last.members for r in rounds[1:])
        # Whoever waited out the leader suspects it (a strike: quarantined after three).
        assert any(leader in r.conduct.suspects for r in rounds[1:])
        assert time.monotonic() - started < 60
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await stop_peers(peers)


async def test_a_stream_flood_is_refused_per_peer_and_rounds_go_on():
    # The flooder heartbeats as a peer in training that never averages: a and b wait a gather out.
    peers = await start_peers(3, max_streams_per_peer=8, gather_timeout=1.5, **STEADY)
    try:
        (_, ra, ma), (_, rb, mb), (flooder, rc, _) = peers
        await settle(peers)
        rc.hostile = Behaviour(flood=True)
        rc.flood()
        for _ in range(200):
            if rejected(ma, "stream_flood") and rejected(mb, "stream_flood"):
                break
            await asyncio.sleep(0.05)
        assert rejected(ma, "stream_flood") > 0 and rejected(mb, "stream_flood") > 0
        assert ra.swarm.streams.open_streams(flooder.peer_id) <= 8
        # A peer that keeps us at its stream cap is no member to group with: a strike a second.
        for _ in range(400):
            if all(r.conduct.quarantine.quarantined(flooder.peer_id, time.monotonic()) for r in (ra, rb)):
                break
            await asyncio.sleep(0.05)
        assert quarantined(ma, "stream_flood") == 1 and quarantined(mb, "stream_flood") == 1
        # And a and b still average.
        results, outcomes = await until_committed([ra, rb], honest_inputs(2, 256))
        assert all(res is not None for res in results), story(outcomes)
        assert torch.equal(results[0][0], results[1][0])
    finally:
        if rc._flood_task is not None:
            rc._flood_task.cancel()
        await stop_peers(peers)


async def test_an_outsider_gets_no_round_or_state_service_from_a_closed_swarm():
    from hivemind.p2p import P2P

    from node.metrics import NodeMetrics
    from p2p.commits import CommitLog
    from p2p.config import SwarmConfig
    from p2p.membership import new_authority
    from p2p.rounds import RoundProtocol
    from p2p.swarm import Swarm, peer_id_from
    from p2p.snapshot import Snapshot; from p2p.stateserver import StateServer
    from p2p.wire import read_frame, write_frame

    metrics = NodeMetrics()
    member = await Swarm.start(SwarmConfig(authority=new_authority()[1], **FAST), "closed", identity_path=None,
                               on_reject=lambda reason: metrics.rejected_messages.labels(reason=reason).inc())
    rounds, server = RoundProtocol(member, metrics), StateServer(member, metrics, CommitLog(member.scope, "g"))
    await rounds.start()
    await server.start()
    server.snapshot = Snapshot.build(0, "g", [torch.ones(4)], [torch.zeros(4)], 1 << 16)
    outsider = await P2P.create(initial_peers=member.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False,
                                nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    try:
        for name, request in ((rounds._names["ready"], {"r": 0}), (rounds._names["begin"], {"r": 0}),
                              (server.name, {"op": "meta"}), (server.name, {"op": "range", "offset": 0})):
            _, reader, writer = await outsider.call_binary_stream_handler(peer_id_from(member.peer_id), name)
            await write_frame(writer, request)
            with pytest.raises(Exception):  # the stream is closed on it: no answer, no byte of state
                await read_frame(reader, 5.0)
            writer.close()
        assert rejected(metrics, "not_admitted") >= 4
        assert metrics.registry.get_sample_value("gonka_node_state_served_total") == 0
    finally:
        await outsider.shutdown()
        await member.close()


async def test_a_peer_whose_state_showed_no_chain_vouches_for_nothing_while_it_announces_it():
    # Two of four others announce a far newer state that showed no certificate chain: once
    # recorded, their word does not make us follow (nor re-sync in vain, announced as joining,
    # while they run ahead as a majority of the live). A new state of theirs is heard again,
    # and so is the same one after the quarantine period.
    from types import SimpleNamespace

    from p2p.quorum import follow, live_peers

    [(swarm, rounds, _)] = await start_peers(1)
    try:
        def record(round, params_hash):
            return SimpleNamespace(round=round, state="training", params_hash=params_hash)

        table = {"liar0": record(1000, "zeros"), "liar1": record(1001, "zeros"), "a": record(3, "h3"),
                 "b": record(3, "h3")}
        now = time.monotonic()
        mine = (3, "h3")
        excluded = rounds.conduct.not_vouching(table, now)
        assert follow(table, swarm.peer_id, mine, excluded=excluded, patient=True)[0] == "behind"
        for liar in ("liar0", "liar1"):
            rounds.conduct.unverified(liar, "zeros")
        assert rounds.conduct.not_vouching(table, now) == {"liar0", "liar1"}
        excluded = rounds.conduct.not_vouching(table, now)
        assert follow(table, swarm.peer_id, mine, excluded=excluded, patient=True) == ("", [])
        assert {"liar0", "liar1"} <= live_peers(table, swarm.peer_id)  # they still count as live
        table["liar1"] = record(1002, "other")
        assert rounds.conduct.not_vouching(table, now) == {"liar0"}
        assert rounds.conduct.not_vouching(table, now + rounds.conduct.quarantine.seconds + 1) == set()
    finally:
        await swarm.close()
