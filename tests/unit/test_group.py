"""One averaging group's pure bookkeeping: parts, pieces, lanes, what encoding keeps, the vote (no network)."""

import itertools
import os

import pytest
import torch

import p2p.compression
import p2p.group
from p2p.codecs import get_codec
from p2p.compression import flatten, owned_bounds, part_bounds
from p2p.digests import digest, piece_digest
from p2p.failure import RoundFailed
from p2p.group import Group
from p2p.lanes import lanes_for_rtt

pytestmark = pytest.mark.timeout(60)


def test_part_bounds_cover_everything():
    for numel, parts in [(10, 3), (3, 5), (1000, 7)]:
        b = part_bounds(numel, parts)
        assert b[0][0] == 0 and b[-1][1] == numel
        assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
        assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


def test_members_that_own_no_part_get_empty_ranges_and_the_owners_split_everything():
    assert owned_bounds(10, [True] * 3) == part_bounds(10, 3)
    assert owned_bounds(10, [False, True, False, True, False]) == [(0, 0), (0, 5), (5, 5), (5, 10), (10, 10)]


async def test_a_member_that_owns_no_part_audits_nothing_and_hears_only_the_owners_votes():
    # a, c own the parts (dialable); b and d (behind NATs) own none and never meet each other.
    members, owners = ["a", "b", "c", "d"], ["a", "c"]

    def group(me: str) -> Group:
        return Group(os.urandom(16), 0, members, me, torch.zeros(1000), 1.0, get_codec("fp32"), owners=owners)

    a, b, c = group("a"), group("b"), group("c")
    assert a.leader == "a" and [len(p) for p in a.pieces] == [1, 0, 1, 0]
    assert a.audit.owner() == 2 and c.audit.owner() == 0 and b.audit.owner() is None
    assert b.audit.target() is None and a.voters() == [0, 1, 2, 3] and b.voters() == [0, 2]
    digest_ = os.urandom(16)
    b.add_vote(1, digest_)
    b.add_vote(0, digest_)
    b.add_vote(2, digest_)
    assert await b.agreed(float("inf"))  # d's vote never comes to b: the owners' carry it
    b.add_vote(3, os.urandom(16))  # were one to come, it would not count
    assert await b.agreed(float("inf"))
    a.add_vote(0, digest_)
    a.add_vote(2, digest_)
    a.add_vote(1, digest_)
    a.add_vote(3, os.urandom(16))
    assert not await a.agreed(float("inf"))  # an owner holds every member to the same digest
    for bad in (["a"], ["c", "a"], ["a", "e"], members):
        with pytest.raises(AssertionError):
            Group(os.urandom(16), 0, members, "a", torch.zeros(10), 1.0, get_codec("fp32"), owners=bad)


def test_flatten_copies_every_tensor_once_and_adds_the_residual_on_the_way():
    tensors = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.arange(2, dtype=torch.float16)]
    expected = torch.cat([t.reshape(-1).float() for t in tensors])
    assert torch.equal(flatten(tensors), expected)
    out, plus = torch.full((19,), float("nan")), torch.randn(19)
    assert flatten(tensors, out) is out and torch.equal(out, expected)
    assert flatten(tensors, out, plus) is out and torch.equal(out, expected + plus)
    with pytest.raises(ValueError, match="out="):
        flatten(tensors, torch.empty(18))
    with pytest.raises(ValueError, match="plus="):
        flatten(tensors, out, torch.empty(19, dtype=torch.float64))


@pytest.mark.parametrize("feedback", [True, False])
def test_encoding_keeps_what_receivers_decode_of_our_part_and_what_feedback_needs_of_all(feedback, monkeypatch):
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    flat, codec = torch.randn(3000), get_codec("int4")
    own_start, own_end = p2p.compression.part_bounds(3000, 3)[1]
    sent = torch.full((own_end - own_start,), float("nan"))  # our own part's size, not the vector's
    residual = torch.full((3000,), float("nan")) if feedback else None
    group = Group(os.urandom(16), 0, ["a", "b", "c"], "b", flat, 1.0, codec, residual, sent)
    assert group.sent is sent
    with pytest.raises(AssertionError):
        Group(os.urandom(16), 0, ["a", "b", "c"], "b", flat, 1.0, codec, residual, torch.empty(3000))
    for j in range(3):
        for k, (start, end) in enumerate(group.pieces[j]):
            payload = group.encode_piece(j, k)
            decoded = codec.decode(payload, end - start)
            if j == group.index:  # we average our own piece as its receivers would decode it
                assert torch.equal(sent[start - own_start : end - own_start], decoded)
                assert torch.equal(group.sent_values(start, end), decoded)
            if feedback:  # what the receivers will not get of every piece
                assert torch.equal(residual[start:end], flat[start:end] - decoded)
    assert not torch.isnan(sent).any()  # every value of our part was encoded


def test_far_groups_get_more_lanes_so_a_new_streams_first_windows_still_fill_the_path():
    # 4 lanes per 50 ms of the farthest member's round-trip time, up to 16; 4 when unknown.
    assert [lanes_for_rtt(r) for r in (None, 0.0, 0.0004, 0.05, 0.051, 0.1, 0.15, 0.25, 2.0)] == \
        [4, 4, 4, 4, 8, 8, 12, 16, 16]


def test_every_piece_travels_on_exactly_one_lane_and_a_lane_opens_once(monkeypatch):
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    for numel, per_part in itertools.product((4, 3 * 256, 40 * 256 + 3), (4, 16)):  # 1, 2 and ~14 pieces a part
        group = Group(os.urandom(16), 0, ["a", "b", "c"], "a", torch.randn(numel), 1.0, get_codec("fp32"),
                      lanes_per_part=per_part)
        for j in range(3):
            lanes = group.lanes(j)
            assert 1 <= lanes <= per_part and lanes == min(per_part, max(1, len(group.pieces[j])))
            carried = sorted(k for lane in range(lanes) for k in group.lane_pieces(j, lane))
            assert carried == list(range(len(group.pieces[j])))
    group.part.add_lane(1, 0, 2.0)
    group.part.add_lane(1, 1, 2.0)  # the same weight on every lane of a member
    assert group.part.weights[1] == 2.0
    with pytest.raises(RoundFailed, match="duplicate_part"):
        group.part.add_lane(1, 1, 2.0)
    with pytest.raises(RoundFailed, match="bad_weight"):
        group.part.add_lane(1, 2, 3.0)
    with pytest.raises(RoundFailed, match="bad_lane"):
        group.part.add_lane(2, group.lanes(0), 1.0)
    with pytest.raises(RoundFailed, match="bad_lane"):
        group.part.add_lane(2, -1, 1.0)


async def test_group_refuses_duplicates_and_never_encodes_non_finite_input():
    flat = torch.randn(1000)
    group = Group(os.urandom(16), 0, ["a", "b"], "a", flat, 1.0, get_codec("int8"))
    with pytest.raises(RoundFailed, match="duplicate_part"):
        group.part.add_weight(0, 2.0)  # our own weight is in already
    with pytest.raises(RoundFailed, match="bad_weight"):
        group.part.add_weight(1, float("nan"))
    group.part.add_weight(1, 1.0)
    piece = group.check_piece(0, group.encode_piece(0, 0))
    assert not group.part.add_piece(1, 0, piece)
    with pytest.raises(RoundFailed, match="duplicate_part"):
        group.part.add_piece(1, 0, piece)
    flat[3] = float("nan")
    with pytest.raises(RoundFailed, match="non_finite_input"):
        group.encode_piece(0, 0)


def test_the_vote_is_the_hash_of_every_averaged_piece_in_order(monkeypatch):
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    flat = torch.randn(2000)
    codec = get_codec("fp32")
    group = Group(os.urandom(16), 0, ["a", "b"], "a", flat, 1.0, codec)
    places = [(j, k) for j in range(2) for k in range(len(group.pieces[j]))]
    assert len(places) > 4
    for j, k in reversed(places):  # arrival order does not matter
        start, end = group.pieces[j][k]
        if (j, k) != places[0]:
            group.place_piece(j, k, codec.encode(flat[start:end]))
    with pytest.raises(AssertionError):
        group.digest()  # a piece is missing
    start, end = group.pieces[0][0]
    group.place_piece(0, 0, codec.encode(flat[start:end]))
    vote = group.digest()
    assert vote == digest([piece_digest(codec.encode(flat[s:e])) for j in range(2) for s, e in group.pieces[j]], group.id)
    other = Group(os.urandom(16), 0, ["a", "b"], "a", flat, 1.0, codec)
    changed = flat.clone()
    changed[1999] += 1.0
    for j, k in places:
        start, end = other.pieces[j][k]
        other.place_piece(j, k, codec.encode(changed[start:end]))
    assert other.digest() != digest([piece_digest(codec.encode(flat[s:e])) for j in range(2) for s, e in other.pieces[j]], other.id)
    assert other.digest() == digest([piece_digest(codec.encode(changed[s:e])) for j in range(2) for s, e in other.pieces[j]], other.id)


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "fp4"])
def test_the_average_is_kept_encoded_until_commit_then_decoded_over_our_contribution_as_it_is_read(name, monkeypatch):
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    codec = get_codec(name)
    flat, average = torch.randn(3001), torch.randn(3001)
    original = flat.clone()
    group = Group(os.urandom(16), 0, ["a", "b", "c"], "b", flat, 1.0, codec)
    for j, part in enumerate(group.pieces):
        for k, (start, end) in enumerate(part):
            group.place_piece(j, k, codec.encode(average[start:end]))
    # Until the round commits our contribution stays whole (audits, a retry) and no fp32 result exists.
    assert torch.equal(flat, original)
    stored = sum(len(d) for part in group._averaged for d in part)
    assert stored == sum(group.wire_bytes(j) for j in range(3))
    like = [torch.empty(10, 30), torch.empty(0), torch.empty(1500), torch.empty(1201)]
    avg = group.committed_average(like)
    expected = torch.cat([codec.decode(codec.encode(average[s:e]), e - s) for part in group.pieces for s, e in part])
    # Read tensor by tensor (as the outer step does), each decoded over ``flat`` only as far as it needs.
    assert [tuple(v.shape) for v in avg.views] == [(10, 30), (0,), (1500,), (1201,)] and torch.equal(flat, original)
    first = avg[0]
    assert first.data_ptr() == flat.data_ptr() and torch.equal(first.reshape(-1), expected[:300])
    assert torch.equal(flat[512:], original[512:])  # the pieces past the first tensor's end are still encoded
    assert [tuple(t.shape) for t in avg] == [(10, 30), (0,), (1500,), (1201,)]
    assert torch.equal(flat, expected) and all(d is None for d in avg._encoded)
    assert all(torch.equal(t, v) for t, v in zip(avg.decoded(), avg.views))


@pytest.mark.parametrize("name, bad", [
    ("fp32", lambda data: torch.tensor([float("nan")]).numpy().tobytes() + data[4:]),
    ("bf16", lambda data: torch.tensor([float("inf")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes() + data[2:]),
    ("int8", lambda data: data[:-1] + bytes([0x80])),  # code -128
    ("int8", lambda data: torch.tensor([float("inf")]).numpy().tobytes() + data[4:]),  # a scale
    ("fp4", lambda data: data[:-1] + bytes([0x00])),  # code 0
])
def test_an_averaged_piece_that_would_not_decode_is_refused_when_placed(name, bad, monkeypatch):
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    codec = get_codec(name)
    flat = torch.randn(1000)
    group = Group(os.urandom(16), 0, ["a", "b"], "a", flat, 1.0, codec)
    start, end = group.pieces[1][0]
    data = codec.encode(torch.randn(end - start))
    with pytest.raises(RoundFailed) as e:
        group.place_piece(1, 0, bad(data))
    assert e.value.reason == "bad_payload"
    group.place_piece(1, 0, data)  # the same piece well formed is placed


def test_an_abort_is_pinned_on_its_starter_also_when_its_dropped_stream_failed_us_first():
    def group():
        return Group(os.urandom(16), 0, ["a", "b", "c"], "a", torch.zeros(10), 1.0, get_codec("fp32"))

    g = group()  # b's abort came first; c only passed it on
    g.aborted_by("c", "aborted_by_peer")
    g.aborted_by("b", "hostile")
    assert g.aborts.starter() == "b"
    g = group()  # our own timeout came first: the others' aborts only answer it
    g.fail("timeout")
    g.aborted_by("b", "hostile")
    assert g.aborts.starter() is None
    g = group()  # b dropped its stream to us, then said it aborted: b started it
    g.fail("truncated", "stream closed after 0 bytes", by="b")
    g.aborted_by("c", "aborted_by_peer")
    g.aborted_by("b", "hostile")
    assert g.aborts.starter() == "b" and g.failure.reason == "truncated"


def test_an_abort_names_the_member_it_failed_on_and_a_named_culprit_must_be_another_member():
    def group(me="a"):
        return Group(os.urandom(16), 0, ["a", "b", "c"], me, torch.zeros(10), 1.0, get_codec("fp32"))

    g = group()
    assert g.culprit("hostile") is None  # about nobody else: our own failure
    g.fail("truncated", by="c")
    assert g.culprit("truncated") == 2  # whose stream failed us
    g = group()
    g.blame["b"] = "non_finite"
    assert g.culprit("non_finite") == 1  # whose input we refused
    g = group()
    assert g.culprit("timeout") == 1  # at the deadline: one we still wait for (b's part is not in)
    # What a member's abort names: another member, by index, or nothing that counts.
    for culprit, named in [(2, "c"), (0, "a"), (1, None), (3, None), (-1, None), (True, None), ("2", None),
                           (None, None)]:
        g = group()
        g.aborted_by("b", "timeout", culprit)
        assert g.aborts.starter() == "b" and g.aborts.named("b") == named, culprit


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4", "fp4"])
def test_in_place_an_attempt_leaves_our_vector_and_a_commit_writes_the_next_residual_over_it(name, monkeypatch):
    """Error feedback's vector is the round's (``Group.in_place``): encoding keeps nothing and
    writes nothing, so an attempt that fails leaves our compensated contribution as it was; an
    auditor and our own part get the bytes we sent, encoded again; once the round commits the
    next residual is written over the vector, and the average is decoded into tensors of its
    own."""
    monkeypatch.setattr(p2p.group, "PIECE_ELEMS", 256)
    codec = get_codec(name)
    torch.manual_seed(7)
    flat = torch.randn(3001) * torch.exp2(torch.randint(-30, 12, (3001,)).float())  # many magnitudes
    original = flat.clone()
    group = Group(os.urandom(16), 0, ["a", "b", "c"], "b", flat, 1.0, codec, residual=flat)
    assert group.in_place and group.sent is None
    everything = [(j, k) for j, part in enumerate(group.pieces) for k in range(len(part))]
    for j, k in everything[::2]:  # an attempt that fails part way
        group.encode_piece(j, k)
    assert torch.equal(flat.view(torch.int32), original.view(torch.int32))
    payloads = {(j, k): group.encode_piece(j, k) for j, k in everything}  # the next attempt
    assert torch.equal(flat.view(torch.int32), original.view(torch.int32))
    for (j, k), payload in payloads.items():
        start, end = group.pieces[j][k]
        assert payload == codec.encode(original[start:end])  # what the owner gets
        assert group.contribution(j, k) == payload  # what an auditor gets
    for k in range(len(group.pieces[group.index])):
        assert group.own_input(k) == payloads[(group.index, k)]  # decoded when its piece is averaged
    average = torch.randn(3001)
    for j, part in enumerate(group.pieces):
        for k, (start, end) in enumerate(part):
            group.place_piece(j, k, codec.encode(average[start:end]))
    group.write_residual()  # the round committed
    for (j, k), payload in payloads.items():
        start, end = group.pieces[j][k]
        assert torch.equal(flat[start:end], original[start:end] - codec.decode(payload, end - start))
    residual = flat.clone()
    like = [torch.empty(10, 30), torch.empty(0), torch.empty(1500), torch.empty(1201)]
    avg = group.committed_average(like)
    expected = torch.cat([codec.decode(codec.encode(average[s:e]), e - s) for part in group.pieces for s, e in part])
    tensors = [avg[i] for i in range(len(avg))]
    assert [tuple(t.shape) for t in tensors] == [(10, 30), (0,), (1500,), (1201,)]
    assert torch.equal(torch.cat([t.reshape(-1) for t in tensors]), expected)
    assert torch.equal(avg[2].reshape(-1), expected[300:1800])  # read again, out of order
    assert torch.equal(flat, residual) and all(t.data_ptr() != flat.data_ptr() for t in tensors if t.numel())
