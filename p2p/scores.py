"""What one round says about each member's input: its size, how it agrees with the others', copies.

Every part owner already holds every member's input to its part, decoded, when it
averages a piece (``Group.reduce_piece``). It also computes the piece's Gram matrix,
the inner products of every pair of inputs (``piece_gram``: one M x n by n x M product,
M members), and appends it to its declaration of the piece's inputs. The declaration
travels with the averaged piece and is part of the vote (p2p/digests.py), so every
member holds the same Gram matrices, and an audit of a piece recomputes its matrix
from the inputs it fetches anyway (``gram_matches``): no byte more on the wire than
the matrix itself (M(M+1)/2 doubles a piece: 288 B for 8 members, against 2^18
values of fp32 or 2^22 of a sparse codec), no trust beyond the audit's.

Summed over every piece of every part, in a fixed order and exactly rounded
(``math.fsum``), the matrices give the same Gram matrix of the members' whole
inputs on every member (``total_gram``), and from it the scores (``member_scores``):
each input's norm, its *agreement* (the median of its cosines with every other
member's input: robust to a minority of liars, whatever their norms), the largest
of those cosines and whose it is (two members sending the same vector: a copy), and
its norm per token claimed relative to the median member's (a member that trained
far less than it claims). p2p/ledger.py turns scores into verdicts and credit.

Cost per piece, on the owner's tensor thread: one stacked copy of the decoded inputs and one
M x M product, measured 1.35x the piece's clip + encode for 2^18 fp32 values of 8 members and
2.2x for a sparse codec's 2^22 (docs/ledger.md: ~6 min a round per owner at 70B sparse).
Members only sum.
"""

from __future__ import annotations

import math
import statistics
import struct
from dataclasses import dataclass

import torch

# A declared entry may differ from the auditor's recompute by this much of the product of the
# two inputs' norms: the owner's fp32 product over 2^22 values rounds differently on another CPU
# (relative error ~1e-5 measured), and a lie inside it moves a cosine by at most this much.
GRAM_TOLERANCE = 1e-3
# Rows with values up to this size are multiplied as they are: 2^22 products of (1e15)^2 sum to
# ~4e36, inside fp32's 3.4e38.
_UNSCALED = 1e15


def pairs(members: int) -> int:
    """Entries of an M x M Gram matrix's upper triangle (with the diagonal)."""
    return members * (members + 1) // 2


def gram_bytes(members: int) -> int:
    """Size of one piece's Gram matrix in a declaration."""
    return 8 * pairs(members)


def _upper(members: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(members) for j in range(i, members)]


def piece_gram(inputs: list[torch.Tensor]) -> bytes:
    """The inner products of every pair of ``inputs`` (one piece, decoded, in member order):
    the upper triangle row by row, as big-endian doubles."""
    x = torch.stack(inputs)
    # A row whose largest magnitude could overflow fp32's sums of products (a liar's 1e30) is
    # scaled by it first, and the scale comes back in float64; honest rows are far below.
    largest = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg()).double()
    scale = torch.where(largest > _UNSCALED, largest, torch.ones_like(largest))
    if bool((scale != 1).any()):
        x.div_(scale.float().unsqueeze(1))
    g = (x @ x.T).double() * scale.unsqueeze(1) * scale.unsqueeze(0)
    m = len(inputs)
    return struct.pack(f"!{pairs(m)}d", *(g[i, j].item() for i, j in _upper(m)))


def parse_gram(data: bytes, members: int) -> list[float]:
    """A piece's Gram matrix as its owner declared it (upper triangle); ValueError if it cannot be
    one: the wrong size, not finite, a negative squared norm, or an inner product larger than the
    norms allow (Cauchy-Schwarz, with the rounding's slack)."""
    if len(data) != gram_bytes(members):
        raise ValueError("gram of the wrong size")
    values = struct.unpack(f"!{pairs(members)}d", data)
    if not all(math.isfinite(v) for v in values):
        raise ValueError("gram not finite")
    diag = [values[_index(members, i, i)] for i in range(members)]
    if any(d < 0 for d in diag):
        raise ValueError("negative squared norm")
    for (i, j), v in zip(_upper(members), values):
        if abs(v) > math.sqrt(diag[i] * diag[j]) * (1 + GRAM_TOLERANCE) + 1e-30:
            raise ValueError("inner product beyond the norms")
    return list(values)


def _index(members: int, i: int, j: int) -> int:
    """Position of (i, j), i <= j, in the upper triangle."""
    return i * members - i * (i - 1) // 2 + (j - i)


def gram_matches(declared: list[float], recomputed: list[float], members: int) -> bool:
    """Whether an owner's declared matrix is the auditor's recompute, within GRAM_TOLERANCE."""
    diag = [recomputed[_index(members, i, i)] for i in range(members)]
    return all(abs(d - r) <= GRAM_TOLERANCE * math.sqrt(diag[i] * diag[j]) + 1e-30
               for (i, j), d, r in zip(_upper(members), declared, recomputed))


def total_gram(pieces: list[list[float]], members: int) -> list[list[float]]:
    """The members' Gram matrix over the whole vector from every piece's (in vector order), as a
    full symmetric matrix; each entry an exactly rounded sum, so the same on every member."""
    n = pairs(members)
    sums = [math.fsum(p[e] for p in pieces) for e in range(n)]
    g = [[0.0] * members for _ in range(members)]
    for (i, j), v in zip(_upper(members), sums):
        g[i][j] = g[j][i] = v
    return g


@dataclass(frozen=True, slots=True)
class Score:
    """One member's input as the round's Gram matrix sees it."""

    norm: float  # its L2 norm
    agreement: float  # median cosine with the other members' inputs (0 for a zero input)
    copy: float  # the largest cosine with another member's input
    partner: int  # whose input that is (member index; -1 in a group of one)
    work: float  # its norm per token claimed, over the median member's (1: typical)


def cosine(g: list[list[float]], i: int, j: int) -> float:
    d = math.sqrt(g[i][i] * g[j][j])
    return g[i][j] / d if d > 0 else 0.0


def member_scores(g: list[list[float]], claimed: list[float]) -> list[Score]:
    """Every member's score from the Gram matrix ``g`` of their inputs and the tokens they
    claimed (in member order). Pure: every member computes the same from the same numbers."""
    m = len(g)
    norms = [math.sqrt(g[i][i]) for i in range(m)]
    rates = [n / w if w > 0 else 0.0 for n, w in zip(norms, claimed)]
    typical = statistics.median(rates) if rates else 0.0
    out = []
    for i in range(m):
        cos = [(cosine(g, i, j), j) for j in range(m) if j != i]
        agreement = statistics.median(c for c, _ in cos) if cos else 0.0
        copy, partner = max(cos) if cos else (0.0, -1)
        out.append(Score(norms[i], agreement, copy, partner, rates[i] / typical if typical > 0 else 0.0))
    return out
