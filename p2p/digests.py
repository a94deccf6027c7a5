"""What the members of a group vote on, as bytes: each averaged piece and its owner's word on its inputs.

An owner sends each averaged piece with a *declaration* of its inputs: every member's
weight as received and a hash of the encoded piece it sent (``DECLARED``, in member
order), then the inner products of the decoded inputs (p2p/scores.py). Every member hashes each piece as it was sent together with that declaration
(``piece_digest``) and votes on one keyed hash over all of them, in vector order, bound
to the group (``digest``). Equal votes mean every member holds the same bytes of every
piece and the same declarations, which an audit can then check against the inputs
(p2p/audit.py: a member whose input the declaration misreports, or an owner whose
average does not follow from the declared inputs, is caught).

Hashing the encoded bytes rather than decoded values is as strong (decoding is a pure
function of the bytes) and, for a 4-bit codec, hashes 8x less.
"""

from __future__ import annotations

import hashlib
import struct

# One entry of an owner's declaration of the inputs of an averaged piece: the member's
# weight as received (float64) and the first 16 bytes of the SHA-256 of its encoded piece.
DECLARED = struct.Struct("!d16s")


def piece_digest(data: bytes | bytearray | memoryview, declared: bytes = b"") -> bytes:
    """Hash of one averaged piece as its owner sent it (the encoded bytes), and of the owner's
    declaration of its inputs (``Group.declaration``), so every member votes on both.

    SHA-256: with the CPU's SHA instructions it hashes ~1.3 GB/s here, twice blake2b."""
    h = hashlib.sha256(data)
    if declared:
        h.update(declared)
    return h.digest()


def input_hash(payload: bytes | bytearray | memoryview) -> bytes:
    """What a declaration records of one member's encoded piece."""
    return hashlib.sha256(payload).digest()[:16]


def parse_declaration(declared: bytes, members: int) -> list[tuple[float, bytes]]:
    """A declaration's entries, in member order: (weight, input hash). The rest of it is the
    piece's Gram matrix (p2p/scores.py, ``declared_gram``)."""
    return [DECLARED.unpack_from(declared, o) for o in range(0, DECLARED.size * members, DECLARED.size)]


def declared_gram(declared: bytes, members: int) -> bytes:
    """The Gram matrix of the piece's inputs that follows the entries (p2p/scores.py)."""
    return declared[DECLARED.size * members:]


def digest(piece_digests: list[bytes], group_id: bytes) -> bytes:
    """What members vote on: the averaged vector, as the hashes of its pieces in order, bound to this group."""
    h = hashlib.blake2b(digest_size=16, key=group_id[:64])
    for d in piece_digests:
        h.update(d)
    return h.digest()
