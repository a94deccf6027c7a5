"""Frames on a stream, over a real unix socket: FrameReader, size limits, write deadlines."""

import asyncio
import os
import struct
import tempfile
import time
import tracemalloc

import pytest
import uvloop

import p2p.wire
from p2p.wire import (FIRST_BUFFER_BYTES, MAX_PAYLOAD_BYTES, READ_AHEAD_BYTES, SMALL_HEADER_BYTES, FrameReader,
                      WireError, linger, read_frame, reply, write_frame)

pytestmark = pytest.mark.timeout(60)

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(loop_name: str, coro_fn):
    loop = LOOPS[loop_name]()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro_fn(), 30))
    finally:
        loop.close()


async def connected(handler):
    """A unix-socket server running ``handler(reader, writer)`` and a client connected to it."""
    path = os.path.join(tempfile.mkdtemp(), "s")
    server = await asyncio.start_unix_server(handler, path)
    reader, writer = await asyncio.open_unix_connection(path)
    return server, reader, writer


@pytest.mark.parametrize("loop_name", LOOPS)
def test_frames_arrive_whole_after_the_stream_reader_hands_over(loop_name):
    sizes = [0, 10, 70_000, 1 << 20, 3 * (1 << 20) + 5, 0, 64 * 1024]
    payloads = [os.urandom(n) for n in sizes]

    async def main():
        got, replied = [], asyncio.get_running_loop().create_future()

        async def handler(reader, writer):
            header, _ = await read_frame(reader, 10)  # the first frame through StreamReader
            await asyncio.sleep(0.2)  # later frames pile up in StreamReader's buffer meanwhile
            frames = FrameReader.attach(reader, writer)
            for _ in sizes:
                got.append(await read_frame(frames, 10))
            # Writing still works, with flow control: more than any socket buffer holds.
            await write_frame(writer, {"ok": True}, b"r" * (8 << 20))
            await linger(frames, 10)  # returns at the client's EOF
            replied.set_result(header)
            writer.close()

        server, reader, writer = await connected(handler)
        async with server:
            await write_frame(writer, {"first": 1})
            for i, p in enumerate(payloads):
                await write_frame(writer, {"i": i}, p)
            header, reply = await read_frame(reader, 10, max_payload=8 << 20)
            assert header == {"ok": True} and reply == b"r" * (8 << 20)
            writer.write_eof()
            assert await replied == {"first": 1}
        assert [h for h, _ in got] == [{"i": i} for i in range(len(sizes))]
        assert [bytes(p) for _, p in got] == payloads
        assert all(isinstance(p, bytearray) for (_, p), n in zip(got, sizes) if n >= 64 * 1024)

    run(loop_name, main)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_stream_that_ends_mid_frame_is_truncated(loop_name):
    async def main():
        result = asyncio.get_running_loop().create_future()

        async def handler(reader, writer):
            frames = FrameReader.attach(reader, writer)
            try:
                await read_frame(frames, 10)
            except WireError as e:
                result.set_result(e.reason)
            writer.close()

        server, reader, writer = await connected(handler)
        async with server:
            writer.write(b"\x00\x00\x00\x01\x00\x10\x00\x00" + b"\x80" + b"x" * 5000)  # {} and 1 MB promised
            await writer.drain()
            writer.close()
            assert await result == "truncated"

    run(loop_name, main)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_reader_that_does_not_read_stops_the_sender(loop_name):
    async def main():
        attached = asyncio.get_running_loop().create_future()
        proceed = asyncio.Event()

        async def handler(reader, writer):
            frames = FrameReader.attach(reader, writer)
            attached.set_result(frames)
            await proceed.wait()
            total = 0
            while chunk := await frames.read(1 << 20):
                total += len(chunk)
            await write_frame(writer, {"total": total})
            writer.close()

        server, reader, writer = await connected(handler)
        async with server:
            frames = await attached
            sending = asyncio.ensure_future(write_frame(writer, {}, b"z" * (64 << 20)))
            await asyncio.sleep(1.0)
            assert not sending.done()  # held back: nobody reads on the other side
            assert frames._hi - frames._lo <= READ_AHEAD_BYTES + (1 << 20)
            proceed.set()
            await sending
            writer.write_eof()
            header, _ = await read_frame(reader, 10)
            assert header["total"] == 8 + 1 + (64 << 20)  # prefix, the empty header, the payload: all of it

    run(loop_name, main)


# ---- bounded resources: buffers grow with what arrived, headers have limits, writes have deadlines ----


async def _stalled_reader(declared: int, sent: bytes, check):
    """A FrameReader handler that reads one frame while the client sends ``sent`` of a frame
    declaring ``declared`` payload bytes and then stalls; ``check(frames)`` runs during the stall."""
    loop = asyncio.get_running_loop()
    attached, result = loop.create_future(), loop.create_future()

    async def handler(reader, writer):
        frames = FrameReader.attach(reader, writer)
        attached.set_result(frames)
        try:
            await read_frame(frames, 10)
            result.set_result("read")
        except WireError as e:
            result.set_result(e.reason)
        writer.close()

    server, reader, writer = await connected(handler)
    async with server:
        frames = await attached
        writer.write(struct.pack("!II", 1, declared) + b"\x80" + sent)
        await writer.drain()
        checked = await check(frames)
        writer.close()
        return checked, await result


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_huge_declared_payload_is_not_allocated_before_it_arrives(loop_name):
    async def stall(frames):
        await asyncio.sleep(0.3)  # the reader has the 10 bytes; whatever it holds now it holds for nothing
        return tracemalloc.get_traced_memory()[0]

    async def main():
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            held, reason = await _stalled_reader(MAX_PAYLOAD_BYTES, b"x" * 10, stall)
        finally:
            tracemalloc.stop()
        assert held - before < FIRST_BUFFER_BYTES + (256 << 10)  # not the 64 MiB it declared
        assert reason == "truncated"

    run(loop_name, main)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_payload_buffers_stay_within_twice_what_arrived(loop_name):
    declared = 9 * (1 << 20) + 123
    payload = os.urandom(declared)

    async def main():
        loop = asyncio.get_running_loop()
        attached, got = loop.create_future(), loop.create_future()

        async def handler(reader, writer):
            frames = FrameReader.attach(reader, writer)
            attached.set_result(frames)
            got.set_result(await read_frame(frames, 10))
            writer.close()

        server, reader, writer = await connected(handler)
        async with server:
            frames = await attached
            writer.write(struct.pack("!II", 1, declared) + b"\x80")
            sent = 0
            for size in [10, 100_000, 1 << 20, 5, 1 << 20, 3 << 20, 1]:
                writer.write(payload[sent : sent + size])
                await writer.drain()
                sent += size
                await asyncio.sleep(0.05)  # let the reader take it
                assert frames._allocated <= max(FIRST_BUFFER_BYTES, 2 * sent), (sent, frames._allocated)
            writer.write(payload[sent:])
            header, data = await got
        assert header == {} and bytes(data) == payload and isinstance(data, bytearray)

    run(loop_name, main)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_payloads_of_every_size_around_the_buffer_steps_arrive_whole(loop_name):
    sizes = [64 * 1024, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 2 << 20, (2 << 20) + 1, 4 << 20, (4 << 20) + 7]
    payloads = [os.urandom(n) for n in sizes]

    async def main():
        got = asyncio.get_running_loop().create_future()

        async def handler(reader, writer):
            frames = FrameReader.attach(reader, writer)
            got.set_result([await read_frame(frames, 10) for _ in sizes])
            writer.close()

        server, reader, writer = await connected(handler)
        async with server:
            for i, p in enumerate(payloads):
                await write_frame(writer, {"i": i}, p)
            frames = await got
        assert [h for h, _ in frames] == [{"i": i} for i in range(len(sizes))]
        assert [bytes(p) for _, p in frames] == payloads

    run(loop_name, main)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_header_limits_are_the_callers(loop_name):
    async def main():
        outcomes = []

        async def handler(reader, writer):
            frames = FrameReader.attach(reader, writer)
            for limits in [dict(max_header=SMALL_HEADER_BYTES, max_payload=0)] * 3:
                try:
                    header, _ = await read_frame(frames, 10, **limits)
                    outcomes.append(sorted(header))
                except WireError as e:
                    outcomes.append(e.reason)
                    break
            writer.close()

        server, reader, writer = await connected(handler)
        async with server:
            await write_frame(writer, {"f": "x" * (SMALL_HEADER_BYTES - 10)})  # just within
            await write_frame(writer, {"r": 1}, b"p")  # a payload where none is expected
            await asyncio.sleep(0.2)
        assert outcomes == [["f"], "oversized_payload"]

        outcomes.clear()
        server, reader, writer = await connected(handler)
        async with server:
            await write_frame(writer, {"f": "x" * SMALL_HEADER_BYTES})  # over the small limit
            await asyncio.sleep(0.2)
        assert outcomes == ["oversized_header"]

    run(loop_name, main)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_write_to_a_peer_that_does_not_read_times_out(loop_name, monkeypatch):
    async def main():
        stop = asyncio.Event()

        async def handler(reader, writer):  # never reads
            await stop.wait()
            writer.close()

        server, reader, writer = await connected(handler)
        async with server:
            started = time.monotonic()
            with pytest.raises(WireError) as e:
                await write_frame(writer, {}, b"z" * (16 << 20), timeout=0.3)
            assert e.value.reason == "write_timeout" and time.monotonic() - started < 3
            assert writer.transport.is_closing()  # aborted: the rest of a half-sent frame is not kept

            monkeypatch.setattr(p2p.wire, "WRITE_TIMEOUT_SECONDS", 0.2)  # the module default applies otherwise
            _, _, writer2 = await connected(handler)
            with pytest.raises(WireError, match="write_timeout"):
                await write_frame(writer2, {}, b"z" * (16 << 20))
            _, _, writer3 = await connected(handler)
            writer3.write(b"y" * (16 << 20))  # the buffer is full: a reply can only wait
            await reply(writer3, {"ok": False})  # and gives up quietly
            assert writer3.transport.is_closing()
            stop.set()

    run(loop_name, main)


class _Transport:
    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def test_bytes_read_ahead_of_the_reader_are_moved_a_bounded_number_of_times(monkeypatch):
    """The transport fills our buffer in small reads while nobody reads (a busy event loop):
    each growth at least doubles it, so the bytes held are copied less than twice in all,
    not once per read (quadratic in what is held)."""
    frames = FrameReader(_Transport(), asyncio.Protocol())
    copied = []
    compact = FrameReader._compact

    def counting(self, spare):
        copied.append(self._hi - self._lo)
        compact(self, spare)

    monkeypatch.setattr(FrameReader, "_compact", counting)
    chunk, total = 16 * 1024, 0
    while total < READ_AHEAD_BYTES:
        buf = frames.get_buffer(-1)
        n = min(chunk, len(buf))
        buf[:n] = b"y" * n
        frames.buffer_updated(n)
        total += n
    assert frames._hi - frames._lo == total
    assert sum(copied) < 2 * total, (len(copied), sum(copied))
    # Once the reader took them, the buffer is small again.
    frames._lo = frames._hi
    frames.get_buffer(-1)
    frames._append(b"z")
    assert len(frames._buf) <= 2 * p2p.wire.DIRECT_READ_BYTES
