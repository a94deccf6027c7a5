"""Hostile members against the round protocol: real swarms of this process (p2pd, DHT, streams),
one member lying the way an attacker would (p2p/hostile.py), the others honest.

Each test ends asserting what the honest members applied: the same bits everywhere, and
nothing the hostile member could steer beyond the bound the design promises."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import pytest_asyncio
import torch

from p2p import audit
from p2p.compression import part_bounds
from p2p.digests import DECLARED as _DECLARED
from p2p.group import Group
from p2p.hostile import Behaviour
from p2p.wire import write_frame
from tests.unit.test_rounds import rejected, start_peers, stop_peers

# One event loop for the module: the swarms that several tests share (module fixtures) live in it.
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


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


@pytest_asyncio.fixture(scope="class", loop_scope="module")
async def five_clipping():
    """5 peers averaging with ``clip``, shared by the lies below (a swarm's start-up, p2pd and
    DHT, costs more than a round): each lie is one round of its own, round numbers counting up."""
    peers = await start_peers(5, min_peers=5, aggregator="clip")
    try:
        await settle(peers)
        yield peers, itertools.count()
    finally:
        await stop_peers(peers)


# The lie with a weight of 1e30 comes last: its weight is capped and quarantined (the test
# below), and a quarantined member would be left out of the next lie's round.
class TestOneLiarAmongFive:  # one swarm for the class, gone after its last test
    @pytest.mark.parametrize("lie", [Behaviour(fill=1e30), Behaviour(fill=3.4e38), Behaviour(fill=-3.4e38),
                                     Behaviour(scale=1e4), Behaviour(scale=-10.0), Behaviour(scale=-1000.0, weight=1e30)],
                             ids=["1e30", "+3.4e38", "-3.4e38", "1e4x", "-10x", "-1000x-weight1e30"])
    async def test_one_hostile_member_among_five_moves_the_average_a_bounded_amount(self, lie, five_clipping):
        peers, rounds_used = five_clipping
        round = next(rounds_used)
        rounds = [r for _, r, _ in peers]
        for s, _, _ in peers:
            s.announce(state="training", round=round)
        await settle(peers)
        rounds[2].hostile = lie
        try:
            inputs = honest_inputs(5)
            results = await attempt(rounds, [x.clone() for x in inputs], round=round)
        finally:
            rounds[2].hostile = Behaviour()
        assert all(res is not None for res in results), [r.last for r in rounds]
        assert all(len(r.last.members) == 5 for r in rounds), [r.last for r in rounds]  # the liar was in
        assert all(torch.equal(res[0], results[0][0]) for res in results)  # one average, everywhere
        honest = [x for i, x in enumerate(inputs) if i != 2]
        honest_mean = torch.stack(honest).mean(0)
        scale = max(float(x.norm()) for x in honest)
        moved = float((results[0][0] - honest_mean).norm())
        # The hostile piece is clipped to the median norm and its weight to twice the median:
        # at most 2/6 of (its clipped norm + the honest mean's) away.
        assert torch.isfinite(results[0][0]).all() and moved <= 0.7 * scale, (moved, scale)


async def test_a_weight_above_the_rounds_cap_is_capped_counted_and_quarantined():
    peers = await start_peers(3, min_peers=3)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        for r in rounds:
            r.weight_cap = 100.0
        rounds[0].hostile = Behaviour(weight=1e30)
        inputs = [torch.full((64,), float(i)) for i in range(3)]
        results = await attempt(rounds, inputs)
        assert all(res is not None for res in results)
        # Capped at 100 against the others' 1 each: 100/102 of the liar's values, not all of them,
        # in the parts honest members own (the liar's own part is its own business: it counted
        # itself with its real weight, and declared that).
        expected = (100 * inputs[0] + inputs[1] + inputs[2]) / 102
        members = sorted(s.peer_id for s, _, _ in peers)
        for index, (start, end) in enumerate(part_bounds(64, 3)):
            if members[index] != peers[0][0].peer_id:
                assert torch.allclose(results[1][0][start:end], expected[start:end], atol=1e-5)
        for _, r, m in peers[1:]:
            assert rejected(m, "weight_capped") == 1 and quarantined(m, "weight_capped") == 1
            assert r.conduct.quarantine.quarantined(peers[0][0].peer_id, time.monotonic())
    finally:
        await stop_peers(peers)


async def test_a_negative_weight_aborts_the_attempt_and_the_others_commit_without_the_liar():
    peers = await start_peers(4, min_peers=3, **STEADY)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        liar = peers[1][0].peer_id
        rounds[1].hostile = Behaviour(weight=-5.0)
        inputs = honest_inputs(4, 256)
        honest = [rounds[0], rounds[2], rounds[3]]
        # The liar keeps trying too; it still heartbeats, so it counts in the quorum (3 of 4 live).
        liar_task = asyncio.ensure_future(_keep_averaging(rounds[1], inputs[1]))
        await seen_ready(peers, liar)  # so that the first group has it
        results, outcomes = await until_committed(honest, [inputs[0], inputs[2], inputs[3]])
        assert max(map(len, outcomes)) <= 3, story(outcomes)  # whoever saw its weight left it out at once
        assert all(torch.equal(res[0], results[0][0]) for res in results)
        assert all(liar not in r.last.members and len(r.last.members) == 3 for r in honest)
        assert sum(r.conduct.quarantine.quarantined(liar, time.monotonic()) for r in honest) >= 1
        liar_task.cancel()
        await asyncio.gather(liar_task, return_exceptions=True)
    finally:
        await stop_peers(peers)


async def _keep_averaging(rounds, x, at=lambda: 0):
    """A hostile member's loop: average at round ``at()`` (the honest peers' round) again and again."""
    while True:
        await rounds.average([x], 1.0, at())
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("span", [None, 1024], ids=["whole_piece", "in_ranges"])
async def test_an_owner_that_alters_its_slice_is_caught_by_the_audit_in_the_same_round(span, monkeypatch):
    # All three in the first group (min_peers=3), so the audit of the altered part happens in it.
    # in_ranges: the auditor fetches each input in 1 KiB ranges (p2p/audit.py AUDIT_SPAN).
    if span:
        monkeypatch.setattr(audit, "AUDIT_SPAN", span)
    peers = sorted(await start_peers(3, min_peers=3, **STEADY), key=lambda p: p[0].peer_id)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        owner = peers[1][0].peer_id
        rounds[1].hostile = Behaviour(alter_slice=True)
        inputs = honest_inputs(3, 2048)
        results = await attempt(rounds, inputs)
        assert results == [None, None, None]  # nothing applied anywhere
        assert all(r.last.status == "aborted" for r in rounds)
        # Member 2 audits member 1's part: it recomputed the piece, blamed the owner, and says so.
        _, auditor, metrics = peers[2]
        assert rejected(metrics, "audit_failed") == 1 and quarantined(metrics, "audit_failed") == 1
        assert auditor.conduct.quarantine.quarantined(owner, time.monotonic())
        # The auditor sent its evidence: the other member checked it and quarantined the owner too.
        assert rounds[0].conduct.quarantine.quarantined(owner, time.monotonic())
        assert quarantined(peers[0][2], "audit_failed") == 1
        task = asyncio.ensure_future(_keep_averaging(rounds[1], inputs[1]))
        rounds[0].min_peers = rounds[2].min_peers = 2
        results, _ = await until_committed([rounds[0], rounds[2]], [inputs[0], inputs[2]])
        assert all(res is not None for res in results) and torch.equal(results[0][0], results[1][0])
        assert owner not in rounds[0].last.members
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await stop_peers(peers)


@pytest.mark.parametrize("span", [None, 1024], ids=["whole_piece", "in_ranges"])
async def test_an_owner_that_misreports_an_input_is_caught_by_that_member_when_it_is_audited(span, monkeypatch):
    # The owner of part 1 declares a wrong hash for member 0's input to every piece of its part.
    # Member 0 checks its own entry only when an auditor asks for that input (member 2 audits
    # part 1): it refuses to hand it over, blames the owner, and nobody blames member 0. Asked
    # in ranges, it counts the lie once.
    if span:
        monkeypatch.setattr(audit, "AUDIT_SPAN", span)
    peers = sorted(await start_peers(3, min_peers=3, **STEADY), key=lambda p: p[0].peer_id)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        owner, member = peers[1][0].peer_id, peers[0][0].peer_id
        declaration = Group.declaration

        def misreported(group, k):
            declared = bytearray(declaration(group, k))
            if group.me == owner:
                declared[_DECLARED.size - 1] ^= 1  # the last byte of member 0's input hash
            return bytes(declared)

        monkeypatch.setattr(Group, "declaration", misreported)
        results = await attempt(rounds, honest_inputs(3, 2048))
        assert results == [None, None, None]  # nothing applied anywhere
        assert all(r.last.status == "aborted" for r in rounds)
        now = time.monotonic()
        assert rejected(peers[0][2], "owner_misreported") == 1 and quarantined(peers[0][2], "owner_misreported") == 1
        assert rounds[0].conduct.quarantine.quarantined(owner, now)
        assert not any(r.conduct.quarantine.quarantined(member, now) for r in rounds)
        assert rejected(peers[2][2], "audit_failed") == 0
    finally:
        await stop_peers(peers)


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
        task = asyncio.ensure_future(_keep_averaging(rounds[3], inputs[3], lambda: current[0]))
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
        task = asyncio.ensure_future(_keep_averaging(x, inputs[0], lambda: current[0]))
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
    peers = sorted(await start_peers(3, gather_timeout=2.0, request_timeout=2.0, **STEADY), key=lambda p: p[0].peer_id)
    try:
        rounds = [r for _, r, _ in peers]
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
    peers = await start_peers(3, max_streams_per_peer=8, gather_timeout=3.0, **STEADY)
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
    from tests.unit.test_rounds import FAST

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


async def test_an_aborted_attempt_leaves_a_donated_vector_and_the_commit_writes_the_residual():
    # int8 with error feedback, donated vectors (as a node runs): the round works on error
    # feedback's vector itself, so the attempt the altered slice spoils must leave it as it was
    # (``Group.in_place``). The retry without the owner then sends what a first attempt would,
    # and its commit leaves exactly what the codec dropped of it.
    peers = sorted(await start_peers(3, min_peers=3, codec="int8", **STEADY), key=lambda p: p[0].peer_id)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        rounds[1].hostile = Behaviour(alter_slice=True)
        inputs = honest_inputs(3, 2048)
        vectors = [x.clone() for x in inputs]
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average([v[:]], 1.0, 0, donate=True) for r, v in zip(rounds, vectors))), 60)
        assert results == [None, None, None] and all(r.last.status == "aborted" for r in rounds)
        for r, v, x in zip(rounds, vectors, inputs):
            assert r.feedback.residual is v and r.feedback.holding
            assert torch.equal(v.view(torch.int32), x.view(torch.int32))  # the residual was zero
        task = asyncio.ensure_future(_keep_averaging(rounds[1], inputs[1].clone()))
        honest = [0, 2]
        for i in honest:
            rounds[i].min_peers = 2

        async def until_commit(r, v):
            for _ in range(6):
                if (result := await r.average([v[:]], 1.0, 0, donate=True)) is not None:
                    return result
            return None

        results = await asyncio.wait_for(asyncio.gather(*(until_commit(rounds[i], vectors[i]) for i in honest)), 90)
        assert all(res is not None for res in results), [rounds[i].last for i in honest]
        assert torch.equal(results[0].decoded()[0], results[1].decoded()[0])
        codec = rounds[0].codec
        for i in honest:
            assert len(rounds[i].last.members) == 2 and not rounds[i].feedback.holding
            sent = torch.cat([codec.decode(codec.encode(inputs[i][s:e]), e - s) for s, e in part_bounds(2048, 2)])
            assert torch.equal(vectors[i], inputs[i] - sent)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await stop_peers(peers)


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
