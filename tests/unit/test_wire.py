"""FrameReader: frames read straight from a stream's transport, over a real unix socket."""

import asyncio
import os
import tempfile

import pytest
import uvloop

from p2p.wire import READ_AHEAD_BYTES, FrameReader, WireError, linger, read_frame, write_frame

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
