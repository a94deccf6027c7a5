"""Frames on a libp2p stream: a small msgpack header plus an optional raw payload.

Every message between peers goes through ``read_frame``, which checks sizes
before reading anything so a hostile peer cannot make us allocate or wait
without bound. Anything malformed raises ``WireError`` with a short ``reason``
that callers count in ``gonka_node_rejected_messages_total``.
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

_PREFIX = struct.Struct("!II")  # header length, payload length


class WireError(Exception):
    """A peer sent something we refuse; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


async def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes | memoryview = b"") -> int:
    """Send one frame; returns the bytes written (for the sent-bytes metric)."""
    packed = msgpack.packb(header, use_bin_type=True)
    assert len(packed) <= MAX_HEADER_BYTES and len(payload) <= MAX_PAYLOAD_BYTES
    writer.write(_PREFIX.pack(len(packed), len(payload)))
    writer.write(packed)
    if len(payload):
        writer.write(payload)
    await writer.drain()
    return _PREFIX.size + len(packed) + len(payload)


async def read_frame(
    reader: asyncio.StreamReader, timeout: float, *, max_payload: int = MAX_PAYLOAD_BYTES
) -> tuple[dict[str, Any], bytes]:
    """Read one frame within ``timeout`` seconds; raise WireError if it is malformed."""
    try:
        async with asyncio.timeout(timeout):
            prefix = await reader.readexactly(_PREFIX.size)
            header_len, payload_len = _PREFIX.unpack(prefix)
            if header_len > MAX_HEADER_BYTES:
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
