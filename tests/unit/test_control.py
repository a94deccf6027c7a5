"""The control socket: request/reply, bad requests, one node per socket path."""

from __future__ import annotations

import asyncio
import os
import socket
import stat

import pytest

from node.control import ControlServer, request


async def status() -> dict:
    return {"peer_id": "12D3test", "round": 3}


async def peers() -> list:
    return [{"peer_id": "a", "state": "training"}]


async def broken() -> None:
    raise KeyError("boom")


@pytest.fixture
def sock_path(tmp_path):
    # tmp_path can be long; unix socket paths are limited to 107 bytes.
    directory = f"/tmp/gonka-test-{os.getpid()}-{id(tmp_path)}"
    yield os.path.join(directory, "sub", "node.sock")
    if os.path.exists(directory):
        for root, dirs, files in os.walk(directory, topdown=False):
            for name in files:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                os.rmdir(os.path.join(root, name))
        os.rmdir(directory)


async def started(path: str) -> ControlServer:
    server = ControlServer(path, {"status": status, "peers": peers, "broken": broken})
    await server.start()
    return server


def raw(path: str, data: bytes, *, hang_up: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(data)
        if hang_up:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def test_round_trip_and_permissions(sock_path):
    server = await started(sock_path)
    try:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(sock_path)).st_mode) == 0o700
        assert await asyncio.to_thread(request, sock_path, "status") == {"peer_id": "12D3test", "round": 3}
        assert await asyncio.to_thread(request, sock_path, "peers") == [{"peer_id": "a", "state": "training"}]
    finally:
        await server.close()
    assert not os.path.exists(sock_path)


async def test_error_replies(sock_path):
    server = await started(sock_path)
    try:
        with pytest.raises(RuntimeError, match="unknown command 'nope'"):
            await asyncio.to_thread(request, sock_path, "nope")
        with pytest.raises(RuntimeError, match="broken failed"):
            await asyncio.to_thread(request, sock_path, "broken")
    finally:
        await server.close()


async def test_garbage_does_not_kill_server(sock_path):
    server = await started(sock_path)
    try:
        for junk in (b"not json\n", b"[1, 2]\n", b'{"cmd": 5}\n', b"\xff\xfe\n", b"x" * 70000 + b"\n", b""):
            reply = await asyncio.to_thread(raw, sock_path, junk)
            assert b'"ok": false' in reply, (junk[:20], reply)
        assert await asyncio.to_thread(request, sock_path, "status") == {"peer_id": "12D3test", "round": 3}
    finally:
        await server.close()


async def test_silent_client_times_out(sock_path, monkeypatch):
    monkeypatch.setattr("node.control.TIMEOUT", 0.3)
    server = await started(sock_path)
    try:
        reply = await asyncio.to_thread(raw, sock_path, b'{"cmd": "sta', hang_up=False)
        assert b"no request within" in reply
        assert await asyncio.to_thread(request, sock_path, "status") == {"peer_id": "12D3test", "round": 3}
    finally:
        await server.close()


async def test_second_server_refuses_live_path(sock_path):
    server = await started(sock_path)
    try:
        with pytest.raises(RuntimeError, match=r"node\.control: .* is in use by another running node"):
            await started(sock_path)
        # The refused server did not take the socket away from the live one.
        assert await asyncio.to_thread(request, sock_path, "status") == {"peer_id": "12D3test", "round": 3}
    finally:
        await server.close()


async def test_stale_socket_is_replaced(sock_path):
    os.makedirs(os.path.dirname(sock_path), mode=0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(sock_path)  # bound, never listening, then closed: what a crash leaves
    dead.close()
    assert os.path.exists(sock_path)
    server = await started(sock_path)
    try:
        assert await asyncio.to_thread(request, sock_path, "peers") == [{"peer_id": "a", "state": "training"}]
    finally:
        await server.close()


async def test_regular_file_is_not_removed(sock_path):
    os.makedirs(os.path.dirname(sock_path), mode=0o700)
    with open(sock_path, "w") as f:
        f.write("precious")
    with pytest.raises(RuntimeError, match="exists and is not a socket"):
        await started(sock_path)
    with open(sock_path) as f:
        assert f.read() == "precious"


def test_client_without_server(sock_path):
    with pytest.raises(ConnectionError, match=r"^no node answering on .*node\.sock: "):
        request(sock_path, "status")


async def test_the_default_directory_must_be_ours_alone(sock_path):
    directory = os.path.dirname(sock_path)
    os.makedirs(directory, mode=0o755)
    os.chmod(directory, 0o755)  # made before us, open to others: refused, nothing created in it
    with pytest.raises(RuntimeError, match="node.control: .* has mode 0755, must be 0700"):
        await ControlServer(sock_path, {"status": status}, private_dir=True).start()
    assert os.listdir(directory) == []
    os.chmod(directory, 0o700)
    if os.getuid() == 0:  # another user's directory (root can hand it over to test this)
        os.chown(directory, 65534, 65534)
        with pytest.raises(RuntimeError, match="belongs to uid 65534, not to this user"):
            await ControlServer(sock_path, {"status": status}, private_dir=True).start()
        os.chown(directory, 0, 0)
    server = ControlServer(sock_path, {"status": status}, private_dir=True)
    await server.start()
    try:
        assert await asyncio.to_thread(request, sock_path, "status") == await status()
    finally:
        await server.close()


async def test_the_default_directory_may_not_be_a_link(sock_path):
    target = os.path.dirname(os.path.dirname(sock_path)) + "-target"
    os.makedirs(target, mode=0o700)
    os.makedirs(os.path.dirname(os.path.dirname(sock_path)))
    os.symlink(target, os.path.dirname(sock_path))
    try:
        with pytest.raises(RuntimeError, match="is not a directory"):
            await ControlServer(sock_path, {"status": status}, private_dir=True).start()
        assert os.listdir(target) == []
    finally:
        os.unlink(os.path.dirname(sock_path))
        os.rmdir(target)
