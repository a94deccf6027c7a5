"""Local control API: a unix socket that `gonka-node status` and `peers` talk to.

The protocol is deliberately tiny so that it can be driven by hand
(`echo '{"cmd": "status"}' | nc -U <path>`): one request per connection, a
JSON object on one line, answered by one JSON line, either
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``.
Only the socket's owner may connect (mode 0600 in a 0700 directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

# A request is a command name; anything larger is not a request.
MAX_REQUEST_BYTES = 64 * 1024
# Replies can hold one row per swarm peer; still bounded so a confused server
# cannot make the client read forever.
MAX_REPLY_BYTES = 16 * 1024 * 1024
# Seconds allowed to each step of a request: reading it, the handler, the reply.
TIMEOUT = 5.0

Handler = Callable[[], Awaitable[Any]]


def check_private_dir(path: str) -> None:
    """Refuse a directory that is not this user's alone (0700, owned by us, not a link): another
    user could otherwise have made it first and swap our socket for theirs."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"node.control: {path} is not a directory (choose another socket with --control)")
    if info.st_uid != os.getuid():
        raise RuntimeError(f"node.control: {path} belongs to uid {info.st_uid}, not to this user "
                           f"(uid {os.getuid()}); remove it or choose another socket with --control")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise RuntimeError(f"node.control: {path} has mode {stat.S_IMODE(info.st_mode):04o}, must be 0700 "
                           f"(chmod 700 it or choose another socket with --control)")


class ControlServer:
    """Serves the node's control commands on a unix socket at `path`."""

    def __init__(self, path: str, handlers: Mapping[str, Handler], *, private_dir: bool = False) -> None:
        self.path = path
        # The default directory is ours alone: refuse one another user made, or opened to others.
        self.private_dir = private_dir
        self._handlers = dict(handlers)
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, mode=0o700, exist_ok=True)
        if self.private_dir:
            check_private_dir(parent)
        await self._remove_stale_socket()
        # asyncio would silently unlink an existing socket here; the check
        # above makes sure that is only ever a dead one.
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=MAX_REQUEST_BYTES)
        os.chmod(self.path, 0o600)
        self._inode = os.stat(self.path).st_ino
        logger.info("control socket listening on %s", self.path)

    async def _remove_stale_socket(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            # Never delete a file the user pointed us at by mistake.
            raise RuntimeError(f"node.control: {self.path} exists and is not a socket")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), TIMEOUT)
        except (ConnectionRefusedError, FileNotFoundError):
            # A socket file with no listener: left by a node that crashed.
            logger.info("removing stale control socket %s", self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        except (OSError, asyncio.TimeoutError) as exc:
            raise RuntimeError(f"node.control: {self.path} cannot be checked: {exc}") from None
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        raise RuntimeError(f"node.control: {self.path} is in use by another running node")

    async def close(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()
        # Remove the file only while it is still ours.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            reply = await self._answer(reader)
            data = json.dumps(reply, default=str).encode() + b"\n"
            writer.write(data)
            await asyncio.wait_for(writer.drain(), TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            # The client went away or stopped reading; nothing to tell it.
            logger.debug("control connection dropped: %r", exc)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        try:
            line = await asyncio.wait_for(reader.readline(), TIMEOUT)
        except asyncio.TimeoutError:
            return {"ok": False, "error": f"no request within {TIMEOUT:g} s"}
        except ValueError:
            # StreamReader's limit: the line is longer than MAX_REQUEST_BYTES.
            return {"ok": False, "error": f"request larger than {MAX_REQUEST_BYTES} bytes"}
        try:
            request = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {"ok": False, "error": 'request is not JSON; send {"cmd": "<name>"} on one line'}
        cmd = request.get("cmd") if isinstance(request, dict) else None
        if not isinstance(cmd, str):
            return {"ok": False, "error": 'request needs a "cmd" string'}
        handler = self._handlers.get(cmd)
        if handler is None:
            known = ", ".join(sorted(self._handlers))
            return {"ok": False, "error": f"unknown command {cmd!r} (known: {known})"}
        try:
            result = await asyncio.wait_for(handler(), TIMEOUT)
        except asyncio.TimeoutError:
            return {"ok": False, "error": f"{cmd}: no answer within {TIMEOUT:g} s"}
        except Exception as exc:
            logger.exception("control command %s failed", cmd)
            return {"ok": False, "error": f"{cmd} failed: {exc}"}
        return {"ok": True, "result": result}


def request(path: str, cmd: str, timeout: float = 5.0) -> Any:
    """Send one command to the node listening on `path` and return its result.

    ConnectionError: nothing answers there. RuntimeError: the node answered
    with an error, or with something that is not a reply.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
            data = _read_line(sock)
        except socket.timeout:
            raise ConnectionError(f"no node answering on {path}: no reply within {timeout:g} s") from None
        except OSError as exc:
            raise ConnectionError(f"no node answering on {path}: {exc.strerror or exc}") from None
    try:
        reply = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RuntimeError(f"invalid reply from {path}: not JSON") from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise RuntimeError(f"invalid reply from {path}: {data[:200]!r}")
    if not reply["ok"]:
        raise RuntimeError(str(reply.get("error", "unknown error")))
    return reply.get("result")


def _read_line(sock: socket.socket) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk:
            break
        if size > MAX_REPLY_BYTES:
            raise OSError(f"reply larger than {MAX_REPLY_BYTES} bytes")
    data = b"".join(chunks)
    if not data:
        raise OSError("connection closed without a reply")
    return data.partition(b"\n")[0]
