"""Bounds on what peers can make this node hold: open streams, per-peer tables, handler time.

A hostile peer can open streams faster than we serve them, send hints or get
itself suspected under ever new ids, or keep a handler waiting forever. Each
of those is capped here, in one place the stream handlers call:
``StreamLimits`` refuses a stream over the per-peer or global cap (the caller
counts ``stream_flood`` and closes it), ``BoundedDict`` keeps a per-peer table
at a fixed size by dropping its oldest entries, and ``handler_deadline`` ends a
handler that outlives its budget with ``WireError("handler_timeout")``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, MutableMapping
from typing import Generic, TypeVar

from p2p.wire import WireError

# Streams all peers together may have open to this node at once.
MAX_STREAMS_TOTAL = 1024

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class StreamLimits:
    """Counts the streams each peer has open to us; refuses one over ``per_peer`` or ``total``.

    Only peers with a stream open have an entry, so the table is bounded by ``total``."""

    __slots__ = ("per_peer", "total", "_open", "_count")

    def __init__(self, per_peer: int, total: int = MAX_STREAMS_TOTAL) -> None:
        if not 1 <= per_peer <= total:
            raise ValueError(f"stream limits need 1 <= per_peer <= total (got {per_peer}, {total})")
        self.per_peer = per_peer
        self.total = total
        self._open: dict[Hashable, int] = {}
        self._count = 0

    def acquire(self, peer: Hashable) -> bool:
        """Take a slot for a new stream from ``peer``; False (nothing taken) when a cap is reached."""
        held = self._open.get(peer, 0)
        if held >= self.per_peer or self._count >= self.total:
            return False
        self._open[peer] = held + 1
        self._count += 1
        return True

    def release(self, peer: Hashable) -> None:
        """Give back a slot taken by a successful ``acquire``."""
        held = self._open[peer]
        assert held > 0 and self._count > 0
        if held == 1:
            del self._open[peer]
        else:
            self._open[peer] = held - 1
        self._count -= 1

    @contextlib.contextmanager
    def slot(self, peer: Hashable) -> Iterator[bool]:
        """``with limits.slot(peer) as admitted:`` a slot for the block if ``admitted``; released on exit."""
        admitted = self.acquire(peer)
        try:
            yield admitted
        finally:
            if admitted:
                self.release(peer)

    def open_streams(self, peer: Hashable | None = None) -> int:
        """Streams open now: from ``peer``, or from everyone."""
        return self._count if peer is None else self._open.get(peer, 0)


class BoundedDict(MutableMapping, Generic[K, V]):
    """A dict of at most ``max_size`` entries: storing a new key past that drops the oldest.

    "Oldest" is the least recently stored: storing an existing key again makes it the
    newest; reading does not. Filter in place with ``retain`` (a comprehension would
    make a plain, unbounded dict)."""

    __slots__ = ("max_size", "_data")

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1 (got {max_size})")
        self.max_size = max_size
        self._data: OrderedDict[K, V] = OrderedDict()

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __setitem__(self, key: K, value: V) -> None:
        data = self._data
        data[key] = value
        data.move_to_end(key)
        while len(data) > self.max_size:
            data.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"BoundedDict({self.max_size}, {dict(self._data)!r})"

    def retain(self, keep: Callable[[K, V], bool]) -> None:
        """Drop every entry for which ``keep(key, value)`` is false."""
        for key in [k for k, v in self._data.items() if not keep(k, v)]:
            del self._data[key]


@contextlib.asynccontextmanager
async def handler_deadline(seconds: float) -> AsyncIterator[None]:
    """``async with handler_deadline(s):`` the whole block within ``s`` seconds, else WireError("handler_timeout").

    Deadlines inside the block (one frame's read, one write) still raise their own
    reasons; this one bounds their sum, whatever the peer does between them."""
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            yield
    except TimeoutError:
        if not deadline.expired():  # someone else's timeout, not ours
            raise
        raise WireError("handler_timeout", f"handler still running after {seconds:.1f}s") from None
