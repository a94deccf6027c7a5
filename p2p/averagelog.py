"""Committed averages kept for joiners: a state download that spans rounds catches up from them.

A big model's state takes longer to download than a round lasts: θ and the outer momentum of a
70B model are 560 GB, 75 minutes into a joiner at 1 Gbit/s, while its swarm commits a round
every 20-30 minutes. Downloading the newest state again after each commit never ends. Instead:

- a donor keeps serving the state a download began on after it moved on (``StateServer``
  pins it while requests for it keep coming);
- every node keeps the averages of its last ``swarm.catchup_rounds`` committed rounds as they
  came over the wire (``AverageLog``: each piece as its owner encoded it, so a round costs the
  codec's bytes, not fp32: 1 byte a parameter with int8, ~0.53 with the 4-bit codecs);
- the joiner, its download done, fetches the averages of the rounds it missed and takes their
  outer steps itself (node/catchup.py), each checked against the ``params_hash`` that
  round's commit certificate names: a single wrong byte gives another hash, and nothing
  unverified is kept.

At 70B with int8 a missed round is 70 GB to fetch instead of 560 GB of state again (9.3 min at
1 Gbit/s, shorter than a round: a joiner gains on the swarm at every round it catches up).

Wire format (p2p/stateserver.py serves it, p2p/transfer.py ``StateDownload.average`` fetches
it): ``avg_meta`` {round} answers {round, prev, new, codec, n} with the payload
msgpack([[start, end, bytes] per piece], piece digests (blake2b-128, concatenated)); pieces are in
vector order and cover [0, numel). ``avg_range`` {round, first, count} answers the encoded
pieces [first, first + count) back to back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack

from p2p.snapshot import DIGEST_BYTES, digest_of

MAX_PIECES = 1 << 22  # pieces of one round's average: 2^18 values each, ~1.1e12 values
MAX_PIECE_BYTES = 16 * 1024 * 1024  # an fp32 piece of 2^18 values is 1 MiB


@dataclass(slots=True)
class RoundAverage:
    """One committed round's average as it came over the wire."""

    round: int  # the round its outer step produced (the worker's round after it)
    prev: str  # params_hash the outer step started from
    new: str  # params_hash it gave
    codec: str
    pieces: list[tuple[int, int]]  # value bounds of each piece, in vector order
    payloads: list[bytes | bytearray | memoryview]  # each piece as its owner encoded it
    _digests: bytes | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)

    def digests(self) -> bytes:
        """Every piece's digest, back to back: computed once, when a joiner first asks (a pass
        over the bytes; off the event loop)."""
        with self._lock:
            if self._digests is None:
                self._digests = b"".join(digest_of(p) for p in self.payloads)
            return self._digests

    def table(self) -> bytes:
        """The ``avg_meta`` payload: the piece table and the piece digests."""
        return msgpack.packb([[s, e, len(p)] for (s, e), p in zip(self.pieces, self.payloads)] + [self.digests()])


def parse_table(payload: bytes, numel: int, codec) -> tuple[list[tuple[int, int, int]], list[bytes]]:
    """A donor's ``avg_meta`` payload: (piece table, piece digests); ValueError unless the pieces
    are in order, cover [0, numel) exactly, each of ``codec``'s exact size for its values and at
    most ``MAX_PIECE_BYTES``, with one digest each."""
    try:
        items = msgpack.unpackb(payload, use_list=True, strict_map_key=True, max_bin_len=len(payload),
                                max_array_len=MAX_PIECES + 1)
    except Exception as e:
        raise ValueError(f"bad piece table: {e!r}"[:80]) from None
    if not isinstance(items, list) or len(items) < 2 or not isinstance(items[-1], bytes):
        raise ValueError("bad piece table")
    rows, digests = items[:-1], items[-1]
    if len(digests) != DIGEST_BYTES * len(rows):
        raise ValueError("bad piece table: digests")
    table, at = [], 0
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and all(type(v) is int for v in row)):
            raise ValueError("bad piece table: row")
        start, end, size = row
        if start != at or end <= start or end > numel or size != codec.wire_bytes(end - start) or size > MAX_PIECE_BYTES:
            raise ValueError("bad piece table: bounds")
        table.append((start, end, size))
        at = end
    if at != numel:
        raise ValueError("bad piece table: does not cover the vector")
    return table, [digests[i : i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES)]


class AverageLog:
    """The last ``keep`` committed rounds' averages, by round (oldest dropped first)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._rounds: OrderedDict[int, RoundAverage] = OrderedDict()

    def add(self, avg: RoundAverage) -> None:
        if self.keep <= 0:
            return
        for r in [r for r in self._rounds if r >= avg.round]:  # a replaced lineage
            del self._rounds[r]
        self._rounds[avg.round] = avg
        while len(self._rounds) > self.keep:
            self._rounds.popitem(last=False)

    def get(self, round: int) -> RoundAverage | None:
        return self._rounds.get(round)

    def clear(self) -> None:
        """Our state was replaced by a download: the averages kept led to a state we left."""
        self._rounds.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._rounds.values())

    def __len__(self) -> int:
        return len(self._rounds)
