"""Frames on a libp2p stream: a small msgpack header plus an optional raw payload.

Every message between peers goes through ``read_frame``, which checks sizes
before reading anything, and grows a payload's buffer only as its bytes
arrive, so a hostile peer cannot make us allocate or wait without bound; every
``write_frame`` has a deadline too, so a peer that stops reading cannot hold
us (or the bytes queued for it) either. Anything malformed raises
``WireError`` with a short ``reason`` that callers count in
``gonka_node_rejected_messages_total``.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

# Header and payload limits. A header is a handful of fields; the payload is a
# slice of tensor bytes (one piece of an all-reduce part, one chunk of state),
# and readers that know the exact size pass a tighter ``max_payload``.
MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
# Header limit for requests and replies that are a few small fields (ready, vote,
# part and state requests): pass ``max_header=SMALL_HEADER_BYTES``.
SMALL_HEADER_BYTES = 4096
# Seconds one ``write_frame`` may wait for a peer to take its bytes (per-call ``timeout``).
WRITE_TIMEOUT_SECONDS = 30.0

_PREFIX = struct.Struct("!II")  # header length, payload length


# Reads at least this long go straight into the caller's buffer instead of through ours.
DIRECT_READ_BYTES = 64 * 1024
# Bytes FrameReader holds for a caller that is not reading before it pauses the stream.
READ_AHEAD_BYTES = 1024 * 1024
# A payload's first buffer; later ones double what arrived. One piece of an
# all-reduce (2^18 fp32) lands in it whole; a declared size is only a promise.
FIRST_BUFFER_BYTES = 1024 * 1024


class WireError(Exception):
    """A peer sent something we refuse; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


async def write_frame(
    writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes | memoryview = b"", *,
    timeout: float | None = None,
) -> int:
    """Send one frame; returns the bytes written (for the sent-bytes metric).

    Waits at most ``timeout`` seconds (default WRITE_TIMEOUT_SECONDS) for the peer to
    take the bytes, then raises WireError("write_timeout") after aborting the stream:
    half a frame went out, so nothing more may follow, and the queued rest is dropped
    instead of held for a peer that does not read."""
    packed = msgpack.packb(header, use_bin_type=True)
    assert len(packed) <= MAX_HEADER_BYTES and len(payload) <= MAX_PAYLOAD_BYTES
    writer.write(_PREFIX.pack(len(packed), len(payload)))
    writer.write(packed)
    if len(payload):
        writer.write(payload)
    transport = writer.transport
    if transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[0]:
        await writer.drain()  # below the low-water mark writing is not paused: this cannot wait
    else:
        limit = WRITE_TIMEOUT_SECONDS if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await writer.drain()
        except TimeoutError:
            transport.abort()
            raise WireError("write_timeout", f"frame not taken within {limit:.1f}s") from None
    return _PREFIX.size + len(packed) + len(payload)


async def read_frame(
    reader: asyncio.StreamReader, timeout: float, *, max_header: int = MAX_HEADER_BYTES,
    max_payload: int = MAX_PAYLOAD_BYTES,
) -> tuple[dict[str, Any], bytes]:
    """Read one frame within ``timeout`` seconds; raise WireError if it is malformed.

    ``max_header``/``max_payload`` bound what the peer may declare: a request that is
    only a header reads with ``max_header=SMALL_HEADER_BYTES, max_payload=0``."""
    try:
        async with asyncio.timeout(timeout):
            prefix = await reader.readexactly(_PREFIX.size)
            header_len, payload_len = _PREFIX.unpack(prefix)
            if header_len > max_header:
                raise WireError("oversized_header", f"{header_len} bytes")
            if payload_len > max_payload:
                raise WireError("oversized_payload", f"{payload_len} bytes")
            packed = await reader.readexactly(header_len)
            payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError as e:
        raise WireError("truncated", f"stream closed after {len(e.partial)} bytes") from None
    except TimeoutError:
        raise WireError("timeout", f"no complete frame within {timeout:.1f}s") from None
    try:
        header = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except Exception as e:
        raise WireError("bad_header", str(e)[:200]) from None
    if not isinstance(header, dict):
        raise WireError("bad_header", "header is not a map")
    return header, payload


async def reply(writer: asyncio.StreamWriter, header: dict[str, Any], *, timeout: float | None = None) -> None:
    """Answer with a header-only frame; a requester that is gone, or does not read, is no error here."""
    try:
        await write_frame(writer, header, timeout=timeout)
    except (ConnectionError, OSError, WireError):
        pass


def field(header: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """Return ``header[name]`` if it has the expected type, else raise WireError."""
    value = header.get(name)
    if isinstance(value, bool) and kind in (int, float):
        raise WireError("bad_field", name)
    if not isinstance(value, kind):
        raise WireError("bad_field", name)
    return value


async def linger(reader: asyncio.StreamReader, timeout: float) -> None:
    """After answering: wait until the requester closes its side (or ``timeout``).

    Closing our end right after the last write can make p2pd reset the stream
    before the tail of a large reply is delivered; the requester closes once it
    has read everything, so its EOF is the acknowledgement."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(64 * 1024):
                pass  # nothing more is expected; anything extra is dropped
    except (TimeoutError, ConnectionError, OSError):
        pass


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a stream without letting a dead peer raise into the caller."""
    try:
        writer.close()
        async with asyncio.timeout(2):
            await writer.wait_closed()
    except Exception:
        pass


class FrameReader(asyncio.BufferedProtocol):
    """A stream's reading side without asyncio.StreamReader: bytes land in place, waiters wake once.

    ``asyncio.StreamReader`` copies every chunk the transport reads into its buffer
    and wakes the reading task for each one; a 1 MB piece arriving over a shaped
    link comes in ~35 chunks, so most of a round's event-loop time went there.
    This protocol takes over the transport (``attach``): a read of at least
    DIRECT_READ_BYTES is received straight into buffers that become the caller's,
    smaller reads come from a small buffer of ours, and the reading task wakes once
    per read. A direct read's buffers grow with what arrived, never with what was
    declared: the first holds FIRST_BUFFER_BYTES (a whole piece of a round), each
    next one as much as arrived before it, and the last is the whole read, with what
    arrived before copied to its front (less than one copy of the read). It offers ``readexactly`` and ``read`` with StreamReader's semantics, so
    ``read_frame`` and ``linger`` take either. The StreamWriter keeps working:
    flow control, end of stream and connection loss are passed on to the stream's
    original protocol.
    """

    def __init__(self, transport: asyncio.BaseTransport, stream_protocol: asyncio.BaseProtocol) -> None:
        self._transport = transport
        self._stream = stream_protocol
        self._buf = bytearray(DIRECT_READ_BYTES)
        self._lo = self._hi = 0  # our buffered bytes are _buf[_lo:_hi]
        # A direct read in progress: where its bytes land now (the end of its last buffer,
        # from _dest_start on) and how much of that is filled.
        self._dest: memoryview | None = None
        self._dest_start = self._filled = 0
        self._segments: list[bytearray] = []  # the direct read's buffers, in order
        self._allocated = 0  # bytes of the read they have room for
        self._need = 0  # the direct read's size
        self._want = 0  # bytes of ours the waiting reader needs
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._error: BaseException | None = None
        self._paused = False

    @classmethod
    def attach(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> "FrameReader":
        """Take over the transport of ``reader``/``writer``, keeping whatever ``reader`` has buffered."""
        transport = writer.transport
        self = cls(transport, transport.get_protocol())
        # StreamReader has no public way to hand over its buffer; _buffer has held it since Python 3.4.
        leftover = bytes(reader._buffer)
        reader._buffer.clear()
        self._append(leftover)
        self._error = reader.exception()
        self._eof = reader.at_eof() or self._error is not None or transport.is_closing()
        transport.set_protocol(self)
        if not self._eof:
            transport.resume_reading()  # StreamReader may have paused it
        return self

    # ---- the protocol -----------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dest is not None:
            return self._dest[self._filled :]
        if self._lo == self._hi:
            self._lo = self._hi = 0
        if len(self._buf) - self._hi < DIRECT_READ_BYTES // 2:
            self._compact(DIRECT_READ_BYTES)
        return memoryview(self._buf)[self._hi :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._dest is not None:
            self._filled += nbytes
            if self._filled == len(self._dest):
                self._next_segment()
            return
        self._hi += nbytes
        if self._waiter is not None and self._hi - self._lo >= self._want:
            self._wake()
        if self._hi - self._lo > READ_AHEAD_BYTES and not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        self._stream.eof_received()
        return True  # keep the writing side open, as StreamReader's protocol does

    def connection_lost(self, exc: BaseException | None) -> None:
        self._eof = True
        self._error = exc
        self._wake()
        self._stream.connection_lost(exc)

    def pause_writing(self) -> None:
        self._stream.pause_writing()

    def resume_writing(self) -> None:
        self._stream.resume_writing()

    # ---- the reading side -------------------------------------------------------

    async def readexactly(self, n: int) -> bytes | bytearray:
        """Exactly ``n`` bytes (a bytearray of the caller's own for large reads); IncompleteReadError at EOF."""
        if n >= DIRECT_READ_BYTES:
            return await self._read_direct(n)
        while self._hi - self._lo < n:
            self._check_open(self._buf[self._lo : self._hi], n)
            await self._wait(n)
        out = bytes(self._buf[self._lo : self._lo + n])
        self._lo += n
        return out

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes once any are there; b"" at EOF."""
        while self._lo == self._hi and not self._eof:
            await self._wait(1)
        if self._lo == self._hi and self._error is not None:
            raise self._error
        end = self._hi if n < 0 else min(self._hi, self._lo + n)
        out = bytes(self._buf[self._lo : end])
        self._lo = end
        return out

    def at_eof(self) -> bool:
        return self._eof and self._lo == self._hi

    async def _read_direct(self, n: int) -> bytearray:
        have = min(n, self._hi - self._lo)
        first = bytearray(max(have, min(n, FIRST_BUFFER_BYTES)))
        first[:have] = self._buf[self._lo : self._lo + have]
        self._lo += have
        self._segments, self._allocated, self._need = [first], len(first), n
        self._dest, self._dest_start, self._filled = memoryview(first), 0, have
        try:
            if have == len(first):
                self._next_segment()
            while self._dest is not None:
                self._check_open(self._segments, n)
                await self._wait(0)
            segments = self._segments
        finally:
            # Not released: the transport may still hold a slice of one of them.
            self._dest, self._segments = None, []
        assert len(segments) == 1 and len(segments[0]) == n
        return segments[0]

    def _next_segment(self) -> None:
        """The current buffer of a direct read is full: give the transport the next one, or finish.

        Each next buffer holds as much again as arrived so far, so what we hold stays
        within twice what the peer sent. The last one is the whole read: what arrived
        is copied to its front (less than the read, once) and the rest lands in place."""
        if self._allocated == self._need:
            self._dest = None  # complete: anything after it is the next frame's, for our buffer
            self._wake()
            return
        arrived = self._allocated
        if self._need - arrived > arrived:
            segment, start = bytearray(arrived), 0
            self._segments.append(segment)
            self._allocated += arrived
        else:
            segment, start = bytearray(self._need), arrived
            at = 0
            for part in self._segments:
                segment[at : at + len(part)] = part
                at += len(part)
            self._segments, self._allocated = [segment], self._need
        self._dest, self._dest_start, self._filled = memoryview(segment)[start:], start, 0

    def _check_open(self, partial, n: int) -> None:
        """Raise if the stream failed or ended; ``partial`` is what arrived (bytes, or a direct read's buffers)."""
        if self._error is not None:
            raise self._error
        if self._eof:
            if isinstance(partial, list):  # only the filled part of the last buffer arrived
                partial = b"".join([*partial[:-1], partial[-1][: self._dest_start + self._filled]])
            raise asyncio.IncompleteReadError(bytes(partial), n)

    async def _wait(self, want: int) -> None:
        self._want = want
        self._waiter = asyncio.get_running_loop().create_future()
        if self._paused:
            self._paused = False
            self._transport.resume_reading()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _append(self, data: bytes) -> None:
        self._compact(len(data))
        self._buf[self._hi : self._hi + len(data)] = data
        self._hi += len(data)

    def _compact(self, spare: int) -> None:
        """Move our bytes to the front of a buffer with at least ``spare`` free bytes after them.

        Always a new bytearray: the transport may still hold a view of the old one. It at least
        doubles what we hold, so bytes read ahead of the reader (up to READ_AHEAD_BYTES) are
        moved a bounded number of times in all, not once per read from the transport; and it
        shrinks back to DIRECT_READ_BYTES once the reader has taken them."""
        held = self._hi - self._lo
        buf = bytearray(max(DIRECT_READ_BYTES, 2 * held, held + spare))
        buf[:held] = self._buf[self._lo : self._hi]
        self._buf, self._lo, self._hi = buf, 0, held
