"""Hostile members against the round protocol: real swarms of this process (p2pd, DHT, streams),
one member lying about what it sends (values, weights, its slice of the average, the hashes it
declares; p2p/hostile.py), the others honest. How the others judge and shun such a member over
rounds, and lies on the streams themselves: test_hostile_conduct.py.

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
from tests.unit.peers import (FAST, attempt, honest_inputs, keep_averaging, quarantined, rejected, seen_ready, settle,
                              start_peers, stop_peers, STEADY, story, until_committed, wait_for)

# One event loop for the module: the swarms that several tests share (module fixtures) live in it.
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


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
        for r in rounds:  # each lie on its own: no standing from the last one's ledger entry
            r.commits.entries.clear()
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
        liar_task = asyncio.ensure_future(keep_averaging(rounds[1], inputs[1]))
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


@pytest.mark.parametrize("span, codec", [(None, "fp32"), (1024, "fp32"), (None, "sparse-c64-k8")],
                         ids=["whole_piece", "in_ranges", "sparse"])
async def test_an_owner_that_alters_its_slice_is_caught_by_the_audit_in_the_same_round(span, codec, monkeypatch):
    # All three in the first group (min_peers=3), so the audit of the altered part happens in it.
    # in_ranges: the auditor fetches each input in 1 KiB ranges (p2p/audit.py AUDIT_SPAN). sparse:
    # the auditor decodes sparse inputs and recomputes the owner's re-sparsified average.
    if span:
        monkeypatch.setattr(audit, "AUDIT_SPAN", span)
    peers = sorted(await start_peers(3, min_peers=3, codec=codec, **STEADY), key=lambda p: p[0].peer_id)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        owner = peers[1][0].peer_id
        rounds[1].hostile = Behaviour(alter_slice=True)
        # The auditor's evidence arrives only after the others left the attempt (the abort it set
        # off came first, as it can under load): it is checked all the same.
        audits = rounds[2].plane.audits
        send = audits._send

        async def evidence_last(peer, name, header, payload):
            if name == "evidence":
                other = next(r for r in rounds if r.swarm.peer_id == peer)
                # A member the auditor's abort did not reach first ends at its deadline (round_timeout).
                await wait_for(lambda: other.plane.ended(header["g"]), 3 * FAST["round_timeout"])
            return await send(peer, name, header, payload)

        audits._send = evidence_last
        inputs = honest_inputs(3, 2048)
        results = await attempt(rounds, inputs)
        assert results == [None, None, None]  # nothing applied anywhere
        assert all(r.last.status == "aborted" for r in rounds)
        # Member 2 audits member 1's part: it recomputed the piece, blamed the owner, and says so.
        _, auditor, metrics = peers[2]
        assert rejected(metrics, "audit_failed") == 1 and quarantined(metrics, "audit_failed") == 1
        assert auditor.conduct.quarantine.quarantined(owner, time.monotonic())
        # The auditor sends its evidence (after the attempt ended everywhere): the other member
        # checks it and quarantines the owner too.
        await wait_for(lambda: rounds[0].conduct.quarantine.quarantined(owner, time.monotonic()),
                       3 * FAST["round_timeout"])
        assert quarantined(peers[0][2], "audit_failed") == 1
        task = asyncio.ensure_future(keep_averaging(rounds[1], inputs[1]))
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

        def misreported(group, k, gram):
            declared = bytearray(declaration(group, k, gram))
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
        task = asyncio.ensure_future(keep_averaging(rounds[1], inputs[1].clone()))
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


async def test_sparse_payloads_a_liar_forges_are_refused_or_clipped():
    # The sparse format's own freedom: legal values as large as the format allows are clipped
    # like any large input; every index of a chunk on one coordinate (or any repeated index) is
    # refused, counted, and the honest members commit without the liar.
    peers = await start_peers(4, min_peers=3, codec="sparse-c64-k8", aggregator="clip", **STEADY)
    try:
        rounds = [r for _, r, _ in peers]
        await settle(peers)
        inputs = honest_inputs(4, 1024)
        rounds[1].hostile = Behaviour(sparse="max")
        results = await attempt(rounds, [x.clone() for x in inputs])
        assert all(res is not None for res in results), [r.last for r in rounds]
        assert all(len(r.last.members) == 4 and torch.equal(res[0], results[0][0]) for r, res in zip(rounds, results))
        honest = torch.stack([x for i, x in enumerate(inputs) if i != 1])
        scale = max(float(x.norm()) for x in honest)
        assert torch.isfinite(results[0][0]).all()
        assert float((results[0][0] - honest.mean(0)).norm()) <= 0.7 * scale

        for s, _, _ in peers:
            s.announce(state="training", round=1)
        await settle(peers)
        liar = peers[1][0].peer_id
        rounds[1].hostile = Behaviour(sparse="pile")
        honest_rounds = [rounds[0], rounds[2], rounds[3]]
        liar_task = asyncio.ensure_future(keep_averaging(rounds[1], inputs[1], at=lambda: 1))
        await seen_ready(peers, liar, round=1)
        results, outcomes = await until_committed(honest_rounds, [inputs[0], inputs[2], inputs[3]], round=1)
        assert all(torch.equal(res[0], results[0][0]) for res in results)
        assert all(liar not in r.last.members for r in honest_rounds), story(outcomes)
        assert sum(rejected(m, "bad_index") + rejected(m, "bad_payload") for i, (_, _, m) in enumerate(peers)
                   if i != 1) >= 1
        liar_task.cancel()
        await asyncio.gather(liar_task, return_exceptions=True)
    finally:
        await stop_peers(peers)
