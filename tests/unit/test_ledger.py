"""Round scores (p2p/scores.py), verdicts, entries and standing (p2p/ledger.py): pure functions."""

import math
import struct

import msgpack
import pytest
import torch

from p2p.commits import CommitCertificate, CommitLog
from p2p.ledger import (DOWN_WEIGHT, STANDING_ROUNDS, Entry, Row, Standing, build_entry, verdicts)
from p2p.scores import (GRAM_TOLERANCE, gram_matches, member_scores, pairs, parse_gram, piece_gram, total_gram)

pytestmark = pytest.mark.timeout(30)


def honest_like(m: int, n: int = 4096, shared: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    """``m`` inputs that agree as pseudo-gradients of one state do: a common direction plus each
    member's own part."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(n, generator=g)
    return [shared * common + torch.randn(n, generator=g) for _ in range(m)]


def scores_of(inputs: list[torch.Tensor], claimed: list[float] | None = None, pieces: int = 4):
    """The scores members compute: Gram matrices of pieces as owners declare them, summed."""
    n = inputs[0].numel()
    bounds = [(k * n // pieces, (k + 1) * n // pieces) for k in range(pieces)]
    grams = [parse_gram(piece_gram([x[a:b].clone() for x in inputs]), len(inputs)) for a, b in bounds]
    g = total_gram(grams, len(inputs))
    return member_scores(g, claimed or [100.0] * len(inputs))


def test_the_summed_piece_grams_are_the_gram_of_the_whole_inputs():
    inputs = honest_like(4)
    g = total_gram([parse_gram(piece_gram([x[a:a + 1024].clone() for x in inputs]), 4)
                    for a in range(0, 4096, 1024)], 4)
    exact = torch.stack(inputs).double() @ torch.stack(inputs).double().T
    assert torch.allclose(torch.tensor(g, dtype=torch.float64), exact, rtol=1e-5)
    # Pieces summed in any order of arrival give the same bits (exactly rounded sums).
    grams = [parse_gram(piece_gram([x[a:a + 1024].clone() for x in inputs]), 4) for a in range(0, 4096, 1024)]
    assert total_gram(grams, 4) == total_gram(grams[::-1], 4)


def test_a_gram_of_huge_inputs_stays_finite():
    inputs = [torch.full((1000,), 3.0e38), torch.full((1000,), -3.0e38), torch.ones(1000)]
    g = parse_gram(piece_gram(inputs), 3)  # no overflow in fp32: scaled first
    assert all(math.isfinite(v) for v in g) and g[0] == pytest.approx(9e76 * 1000, rel=1e-5)


@pytest.mark.parametrize("lie", ["size", "nan", "negative", "cauchy"])
def test_a_declared_gram_that_cannot_be_one_is_refused(lie):
    good = piece_gram(honest_like(3, 256))
    values = list(struct.unpack(f"!{pairs(3)}d", good))
    if lie == "size":
        bad = good[:-8]
    else:
        values[{"nan": 1, "negative": 0, "cauchy": 1}[lie]] = {"nan": float("nan"), "negative": -1.0,
                                                               "cauchy": 1e9}[lie]
        bad = struct.pack(f"!{pairs(3)}d", *values)
    with pytest.raises(ValueError):
        parse_gram(bad, 3)


def test_an_audit_tells_a_changed_gram_from_rounding():
    inputs = honest_like(3, 2048)
    declared = parse_gram(piece_gram(inputs), 3)
    recomputed = parse_gram(piece_gram([x.clone() for x in inputs]), 3)
    assert gram_matches(declared, recomputed, 3)
    nudged = list(declared)
    nudged[1] += 0.1 * GRAM_TOLERANCE * math.sqrt(declared[0] * declared[3])  # within rounding's slack
    assert gram_matches(nudged, recomputed, 3)
    lied = list(declared)
    lied[1] = -lied[1]  # member 0 made to look against member 1
    assert not gram_matches(lied, recomputed, 3)


def test_honest_members_are_not_flagged_and_get_their_tokens_as_credit():
    inputs = honest_like(5)
    claimed = [100.0, 100.0, 100.0, 50.0, 50.0]  # two slow hosts: fewer tokens, a smaller update
    inputs[3] *= 0.6
    inputs[4] *= 0.6
    scores = scores_of(inputs, claimed)
    assert verdicts(scores) == [()] * 5
    entry = build_entry(3, [f"p{i}" for i in range(5)], claimed, claimed, [1.0] * 5, scores)
    assert [r.credit for r in entry.rows] == claimed


@pytest.mark.parametrize("kind,flag", [("zero", "zero"), ("noise", "against"), ("negative", "against"),
                                       ("idle", "idle"), ("copy", "copy")])
def test_a_member_that_did_no_work_or_worked_against_the_others_is_flagged(kind, flag):
    inputs = honest_like(5)
    liar = 2
    if kind == "zero":
        inputs[liar].zero_()
    elif kind == "noise":
        inputs[liar] = torch.randn(4096, generator=torch.Generator().manual_seed(9)) * inputs[liar].norm() / 64
    elif kind == "negative":
        inputs[liar] = -1000 * inputs[liar]
    elif kind == "idle":
        inputs[liar] = inputs[liar] * 0.05  # one step's change, and H steps' tokens claimed
    elif kind == "copy":
        inputs[liar] = inputs[0].clone()
    flags = verdicts(scores_of(inputs))
    assert flag in flags[liar]
    honest = [i for i in range(5) if i != liar and not (kind == "copy" and i == 0)]
    assert all(flags[i] == () for i in honest), flags
    if kind == "copy":  # the original and the copy look alike: both are flagged
        assert "copy" in flags[0]


def test_a_group_of_two_judges_nobody():
    assert verdicts(scores_of([torch.ones(64), torch.zeros(64)])) == [(), ()]


def test_an_entry_round_trips_through_msgpack_and_json_to_the_same_digest():
    scores = scores_of(honest_like(3))
    entry = build_entry(7, ["a", "b", "c"], [1.5, 2.0, 3.0], [1.5, 2.0, 3.0], [1.0, 0.25, 1.0], scores)
    again = Entry.from_list(msgpack.unpackb(entry.pack(), raw=False))
    assert again == entry and again.digest() == entry.digest()
    assert Entry.from_json(entry.to_json()).digest() == entry.digest()


@pytest.mark.parametrize("change", ["flag", "row", "float", "unsorted"])
def test_a_malformed_entry_is_refused(change):
    value = build_entry(2, ["a", "b", "c"], [1.0] * 3, [1.0] * 3, [1.0] * 3, scores_of(honest_like(3))).to_list()
    if change == "flag":
        value[2][0][9] = ["rich"]
    elif change == "row":
        value[2][0] = value[2][0][:-1]
    elif change == "float":
        value[2][1][4] = float("inf")
    else:
        value[2].reverse()
    with pytest.raises(ValueError):
        Entry.from_list(value)


def row(peer: str, flags: tuple = ()) -> Row:
    return Row(peer, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0, 1.0, flags, 0.0 if flags else 1.0)


def test_standing_halves_then_leaves_out_and_forgets_after_the_window():
    log = CommitLog("scope", "genesis")
    flagged = {3: ("against",), 5: ("zero",)}
    for r in range(1, 6):
        log.record(Entry(r, (row("a"), row("liar", flagged.get(r, ())))))
    assert log.standing(2).factor("liar") == 1.0
    assert log.standing(3).factor("liar") == DOWN_WEIGHT and log.standing(4).factor("liar") == DOWN_WEIGHT
    assert log.standing(5).factor("liar") == 0.0 and log.standing(5).left_out() == {"liar"}
    assert log.standing(5).factor("a") == 1.0
    # Left out, it is in no entry; its flags age out of the window of STANDING_ROUNDS rounds.
    for r in range(6, 3 + STANDING_ROUNDS + 1):
        log.record(Entry(r, (row("a"), row("b"))))
    assert log.standing(3 + STANDING_ROUNDS - 1).factor("liar") == 0.0
    assert log.standing(3 + STANDING_ROUNDS).factor("liar") == DOWN_WEIGHT
    assert Standing([]).digest(["a", "b"]) != Standing([Entry(1, (row("a", ("copy",)),))]).digest(["a", "b"])


def test_a_certificate_covers_its_entry():
    entry = Entry(4, (row("a"), row("b")))
    cert = CommitCertificate("scope", 4, "h3", "h4", ("a", "b"), entry)
    tampered = CommitCertificate("scope", 4, "h3", "h4", ("a", "b"), Entry(4, (row("a"), row("b", ("zero",)))))
    assert cert.message() != tampered.message()
    assert CommitCertificate("scope", 4, "h3", "h4", ("a", "b")).message() not in (cert.message(),)
    wire = cert.to_wire()
    assert len(wire) == 7 and CommitCertificate.from_wire(wire).entry == entry
    wire[6][1] = 5  # an entry of another round than its certificate's
    with pytest.raises(ValueError):
        CommitCertificate.from_wire(wire)
