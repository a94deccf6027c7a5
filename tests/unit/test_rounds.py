"""Round protocol between in-process peers over real p2pd daemons on loopback: what a round
computes (bit-identical averages, pieces, codecs and their residuals, donated vectors) and how a
bad piece ends it. How peers meet for a round: test_meeting.py."""

import asyncio
import time

import pytest
import torch

import p2p.group
from p2p.codecs import get_codec
from p2p.compression import average_part, part_bounds, piece_bounds
from p2p.group import Group
from p2p.quarantine import Quarantine
from p2p.rounds import RoundProtocol
from p2p.wire import write_frame
from tests.unit.peers import rejected, start_peers, stop_peers

pytestmark = pytest.mark.timeout(90)


async def test_weighted_average_is_bit_identical_on_every_member():
    peers = await start_peers(3, min_peers=3)
    try:
        torch.manual_seed(0)
        inputs = [[torch.randn(300, 7), torch.randn(13)] for _ in peers]
        weights = [1.0, 2.0, 3.5]  # within twice the median: no cap applies
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average(x, w, 0) for (_, r, _), x, w in zip(peers, inputs, weights))), 60)
        expected = [sum(w * x[k] for w, x in zip(weights, inputs)) / sum(weights) for k in range(2)]
        for res in results:
            assert res is not None, [r.last for _, r, _ in peers]
            for k in range(2):
                assert torch.equal(res[k], results[0][k])
                assert torch.allclose(res[k], expected[k], atol=1e-6)
        assert all(r.last.status == "committed" and len(r.last.members) == 3 for _, r, _ in peers)
        for _, r, _ in peers:  # where each member's time went, step by step after the gather
            phases = r.last.phases
            assert list(phases) == ["exchanged", "audited", "voted"] and min(phases.values()) >= 0, phases
            assert sum(phases.values()) <= r.last.allreduce_seconds
    finally:
        await stop_peers(peers)


class SilentAfterVoting(RoundProtocol):
    """Takes every vote in and acknowledges none: what the others see of a member killed right
    after it committed, before its replies left."""

    async def _on_vote(self, sender, header, reader, writer):
        if "abort" in header:
            return await super()._on_vote(sender, header, reader, writer)
        group, index = await self._group_for(sender, header)
        group.add_vote(index, header["digest"])  # and the stream closes without a reply


async def test_a_member_that_voted_but_never_acknowledged_ours_does_not_fail_the_round():
    # Aborting would leave the round committed by too few members to certify it (seen with a
    # member SIGKILLed at its commit: two of four committed, the third aborted, and the swarm
    # stopped, split between two rounds).
    peers = await start_peers(3, min_peers=3, protocols={2: SilentAfterVoting})
    for _, r, _ in peers:  # the unacknowledged vote is waited out once: 2 s, not the 5 of FAST
        r.dial.request_timeout = 2.0
    try:
        torch.manual_seed(2)
        inputs = [[torch.randn(64)] for _ in peers]
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average(x, 1.0, 0) for (_, r, _), x in zip(peers, inputs))), 60)
        assert all(r.last.status == "committed" for _, r, _ in peers), [r.last for _, r, _ in peers]
        assert all(torch.equal(res[0], results[0][0]) for res in results)
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


def by_member(peers, values):
    """``values`` (one per peer, in peer order) in the group's member order (sorted peer ids)."""
    return [v for _, v in sorted(zip([s.peer_id for s, _, _ in peers], values))]


@pytest.mark.parametrize("codec", ["fp32", "int8", "fp4", "sparse-c64-k4"])
async def test_pieces_average_exactly_as_whole_parts_would(codec, monkeypatch):
    # Small pieces, so every part streams as several of them, the last one short.
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256 // get_codec(codec).piece_factor)
    peers = await start_peers(3, min_peers=3, codec=codec)
    try:
        gen = torch.Generator().manual_seed(2)
        numel = 2000 + 37
        inputs = [torch.randn(numel, generator=gen) for _ in peers]
        weights = [1.0, 1.5, 0.5]  # within twice the median: no cap applies
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average([x], w, 0) for (_, r, _), x, w in zip(peers, inputs, weights))), 60)
        assert all(res is not None for res in results), [r.last for _, r, _ in peers]
        # The arithmetic of the whole-part butterfly (and of the simulator): each member's part
        # encoded at once, averaged in member order, the average encoded once.
        c = get_codec(codec)
        bounds = part_bounds(numel, 3)
        assert all(len(piece_bounds(s, e, c, 256)) > 1 for s, e in bounds)
        expected = torch.empty(numel)
        for s, e in bounds:
            sent = [(w, c.decode(c.encode(x[s:e].contiguous()), e - s))
                    for x, w in by_member(peers, list(zip(inputs, weights)))]
            expected[s:e] = c.average.decode(average_part(c.average, sent), e - s)  # a sparse codec's own
        for res in results:
            assert torch.equal(res[0], expected)
        # What the average kept (a sparse codec's owners keep fewer values than the inputs carry).
        kept = expected != 0 if codec.startswith("sparse") else torch.ones(numel, dtype=torch.bool)
        assert not codec.startswith("sparse") or 0 < int(kept.sum()) <= numel // 7
        for (_, r, _), x in zip(peers, inputs):
            if codec == "fp32":
                assert r.feedback is None
                continue
            # Error feedback kept exactly what the receivers did not get of this member's input:
            # what the codec dropped, and all of what the average did not keep.
            sent = torch.cat([c.decode(c.encode(x[s:e].contiguous()), e - s) for s, e in bounds])
            assert torch.equal(r.feedback.residual, torch.where(kept, x - sent, x))
    finally:
        await stop_peers(peers)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
async def test_the_next_round_reuses_its_buffers_and_leaves_the_last_result_alone(codec, monkeypatch):
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    peers = await start_peers(2, min_peers=2, codec=codec)
    try:
        gen = torch.Generator().manual_seed(3)
        numel, c = 3000, get_codec(codec)
        bounds = part_bounds(numel, 2)

        def receivers_decode(x):  # what the members decode of one member's contribution
            return torch.cat([c.decode(c.encode(x[s:e].contiguous()), e - s) for s, e in bounds])

        first = [torch.randn(numel, generator=gen) for _ in peers]
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average([x], 1.0, 0) for (_, r, _), x in zip(peers, first))), 60)
        kept = results[0][0].clone()

        def held(r):  # every vector the protocol keeps from round to round
            ptrs = {name: buf.data_ptr() for name, buf in r.plane._buffers.items()}
            if r.feedback is not None:
                ptrs["feedback"] = r.feedback.residual.data_ptr()
            return ptrs

        before = held(peers[0][1])
        assert set(before) == ({"flat"} if c.exact else {"flat", "sent", "residual", "feedback"})
        residuals = [r.feedback.residual.clone() if r.feedback else torch.zeros(numel) for _, r, _ in peers]
        second = [torch.randn(numel, generator=gen) for _ in peers]
        again = await asyncio.wait_for(asyncio.gather(
            *(r.average([x], 1.0, 1) for (_, r, _), x in zip(peers, second))), 60)
        after = held(peers[0][1])
        assert after.pop("flat") == before.pop("flat") and after.pop("sent", 0) == before.pop("sent", 0)
        if not c.exact:  # the residual a commit replaced is the buffer of the next one
            assert (after["feedback"], after["residual"]) == (before["residual"], before["feedback"])
        assert torch.equal(results[0][0], kept)  # the first round's result is the caller's alone
        assert torch.equal(again[0][0], again[1][0]) and not torch.equal(again[0][0], kept)
        compensated = [x + res for x, res in zip(second, residuals)]  # error feedback, into the reused copy
        sent = by_member(peers, [receivers_decode(x) for x in compensated])
        expected = torch.cat([c.decode(average_part(c, [(1.0, v[s:e]) for v in sent]), e - s) for s, e in bounds])
        assert torch.equal(again[0][0], expected)
        for (_, r, _), x in zip(peers, compensated):
            if r.feedback is not None:
                assert torch.equal(r.feedback.residual, x - receivers_decode(x))
    finally:
        await stop_peers(peers)


async def test_averaged_pieces_flow_back_before_the_input_is_complete(monkeypatch):
    # The two halves of the butterfly overlap: a part's owner sends its first averaged piece
    # back while a member's later pieces of that part are still on their way.
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    peers = await start_peers(2, min_peers=2)
    (a, ra, _), (b, rb, _) = sorted(peers, key=lambda p: p[0].peer_id)  # a owns part 0
    events = []
    place = Group.place_piece

    def placing(group, index, k, data, declared=b""):
        events.append(("placed", group.me, index, k))
        place(group, index, k, data, declared)

    async def slow_last_piece(group, j, lane, writer):
        for k in group.lane_pieces(j, lane):
            if k == len(group.pieces[j]) - 1:
                await asyncio.sleep(1.0)
                events.append(("last_piece_sent", group.me, j, k))
            await write_frame(writer, {}, group.encode_piece(j, k))

    monkeypatch.setattr(Group, "place_piece", placing)
    rb.exchange._send_pieces = slow_last_piece
    try:
        x, y = torch.randn(4096), torch.randn(4096)
        res = await asyncio.wait_for(asyncio.gather(ra.average([x], 1.0, 0), rb.average([y], 1.0, 0)), 60)
        assert res[0] is not None and torch.equal(res[0][0], res[1][0]) and torch.allclose(res[0][0], (x + y) / 2)
        first_back = events.index(("placed", b.peer_id, 0, 0))
        last_in = events.index(("last_piece_sent", b.peer_id, 0, 7))
        assert first_back < last_in, events
    finally:
        await stop_peers(peers)


@pytest.mark.parametrize("damage, reason", [("bad_code", "bad_payload"), ("short", "bad_size"),
                                            ("long", "oversized_payload")])
async def test_a_bad_piece_mid_stream_fails_the_round_everywhere(damage, reason, monkeypatch):
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    peers = await start_peers(3, min_peers=3, codec="int8")
    (a, ra, ma), (b, rb, mb), (c, rc, mc) = sorted(peers, key=lambda p: p[0].peer_id)

    async def damaged_second_piece(group, j, lane, writer):
        for k in group.lane_pieces(j, lane):
            payload = bytearray(group.encode_piece(j, k))
            if k == 1 and j == 0:  # only a's part is damaged
                if damage == "bad_code":
                    payload[-1] = 0x80  # int8 code -128: no encoder sends it
                elif damage == "short":
                    payload = payload[:-1]
                else:
                    payload += b"\0"
            await write_frame(writer, {}, bytes(payload))

    rb.exchange._send_pieces = damaged_second_piece
    try:
        inputs = [torch.randn(3000) for _ in range(3)]
        res = await asyncio.wait_for(asyncio.gather(
            *(r.average([x], 1.0, 0) for r, x in zip((ra, rb, rc), inputs))), 60)
        assert res == [None, None, None]  # nothing applied anywhere
        assert all(r.last.status == "aborted" for r in (ra, rb, rc))
        assert rejected(ma, reason) == 1 and rejected(mb, reason) == 0 and rejected(mc, reason) == 0
        assert all(r.feedback.residual.abs().max() == 0 for r in (ra, rb, rc))  # only a commit consumes it
        # a refused b's input: a lie, so a leaves b out of its rounds for a while (p2p/quarantine.py).
        assert ra.conduct.quarantine.quarantined(b.peer_id, time.monotonic())
        assert ma.registry.get_sample_value("gonka_node_quarantined_total", {"reason": reason}) == 1
        assert not rc.conduct.quarantine.active(time.monotonic())

        # Once b behaves (and its quarantine is over), the same members average normally.
        ra.conduct.quarantine = Quarantine(60)
        del rb.exchange._send_pieces
        res = await asyncio.wait_for(asyncio.gather(
            *(r.average([x], 1.0, 0) for r, x in zip((ra, rb, rc), inputs))), 60)
        assert all(r is not None and torch.equal(r[0], res[0][0]) for r in res), [r.last for r in (ra, rb, rc)]
    finally:
        await stop_peers(peers)


def _views(vector: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = int(torch.tensor(shape).prod())
        out.append(vector[at : at + n].view(shape))
        at += n
    return out


def test_base_vector_is_found_only_for_consecutive_views_covering_it_or_a_vector_given_alone():
    from p2p.compression import base_vector

    v = torch.zeros(30)
    assert base_vector(_views(v, [(4, 5), (10,)])) is v
    assert base_vector([v]) is v  # a vector of its own, donated as it is
    assert base_vector([torch.zeros(5, 6)]) is None and base_vector([v, torch.zeros(3)]) is None
    assert base_vector([torch.zeros(30, dtype=torch.float64)]) is None
    assert base_vector(_views(v, [(4, 5)])) is None  # not all of it
    assert base_vector(list(reversed(_views(v, [(4, 5), (10,)])))) is None  # out of order
    assert base_vector([torch.zeros(3), torch.zeros(2)]) is None and base_vector([]) is None
    assert base_vector(_views(torch.zeros(30, dtype=torch.float64), [(30,)])) is None


async def test_a_donated_pseudo_gradient_is_the_rounds_buffer_and_takes_the_residual_once():
    # The round reduces the caller's vector itself (no copy of 4 bytes per parameter), which with
    # error feedback becomes the residual's vector (the next residual is written over it); an
    # attempt again with the same tensors after an abort must not add the residual twice.
    peers = await start_peers(3, min_peers=3, codec="int8")
    try:
        shapes = [(40, 30), (17,)]
        torch.manual_seed(3)
        vectors = [torch.randn(1217) for _ in peers]
        mean = sum(vectors) / 3
        results = await asyncio.wait_for(asyncio.gather(
            *(r.average(_views(v, shapes), 1.0, 0, donate=True) for (_, r, _), v in zip(peers, vectors))), 60)
        assert all(res is not None for res in results), [r.last for _, r, _ in peers]
        flat = [torch.cat([t.reshape(-1) for t in res.decoded()]) for res in results]
        assert all(torch.equal(f, flat[0]) for f in flat) and torch.allclose(flat[0], mean, atol=0.05)
        # No copy, no second residual, no vector of what our part's receivers decode: the donated
        # vector holds the next residual now, and the old residual's vector was given back.
        assert all(not ({"flat", "residual", "sent"} & set(r.plane._buffers)) for _, r, _ in peers)
        assert all(r.feedback.residual is v and not r.feedback.holding for (_, r, _), v in zip(peers, vectors))
        (sa, a, _), *_ = peers
        residual = a.feedback.residual.clone()
        assert residual.abs().sum() > 0
        for s, _, _ in peers:
            s.announce(state="training", round=1)
        mine = torch.randn(1217)
        before = mine.clone()
        tensors = _views(mine, shapes)
        alone = asyncio.ensure_future(a.average(tensors, 1.0, 1, donate=True))  # waits for the others...
        for _ in range(600):
            if a.formation.waiting is not None:  # its input is ready: it waits for a group
                break
            await asyncio.sleep(0.05)
        compensated = before + residual
        assert torch.equal(mine, compensated) and a.feedback.residual is mine and a.feedback.holding
        assert a.feedback.state_dict() is None  # a checkpoint now would keep no residual (a Δ is in it)
        alone.cancel()  # ...and ends without a group; the same tensors go again
        await asyncio.gather(alone, return_exceptions=True)
        assert torch.equal(mine, compensated)
        others = [torch.randn(1217) for _ in peers[1:]]
        results = await asyncio.wait_for(asyncio.gather(
            a.average(tensors, 1.0, 1, donate=True),
            *(r.average(_views(v, shapes), 1.0, 1, donate=True) for (_, r, _), v in zip(peers[1:], others))), 60)
        assert all(res is not None for res in results), [r.last for _, r, _ in peers]
        # The residual was added once over two attempts: the next one is what the codec dropped of
        # that, written over the donated vector.
        c = get_codec("int8")
        sent = torch.cat([c.decode(c.encode(compensated[s:e].contiguous()), e - s) for s, e in part_bounds(1217, 3)])
        assert a.feedback.residual is mine and torch.equal(mine, compensated - sent) and not a.feedback.holding
        assert torch.equal(a.feedback.state_dict()["residual"], mine)
        # The average is decoded into tensors of its own as they are read: the same on every member.
        averages = [torch.cat([t.reshape(-1) for t in res.decoded()]) for res in results]
        assert all(torch.equal(x, averages[0]) for x in averages)
        assert all(t.data_ptr() != mine.data_ptr() for t in results[0].decoded())
        # The next pseudo-gradient goes into that vector (``delta_target``): given again, it is the
        # next round's compensated contribution as it stands, nothing added to it.
        assert a.delta_target() is mine
        mine.add_(1.0)  # as pseudo_gradient(into=mine) adds a Δ
        held = mine.clone()
        for s, _, _ in peers:
            s.announce(state="training", round=2)
        again = asyncio.ensure_future(a.average(tensors, 1.0, 2, donate=True))
        for _ in range(600):
            if a.formation.waiting is not None:
                break
            await asyncio.sleep(0.05)
        assert torch.equal(mine, held) and a.feedback.holding and a.delta_target() is None
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)
    finally:
        await stop_peers(peers)
