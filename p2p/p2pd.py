"""The node's one child process, go-libp2p's ``p2pd``: started so that it dies with the node.

hivemind starts ``p2pd`` with ``create_subprocess_exec`` and offers no hook; while
``Swarm.start`` creates its ``P2P``, ``children_die_with_us`` runs every child through a
tiny launcher that asks the kernel for SIGKILL when the node dies (``PR_SET_PDEATHSIG``),
also after the node's own SIGKILL, and sets ``P2PD_ENVIRONMENT``. A multi-rank host's
launcher starts its ranks the same way (``dying_with_us``, node/launch.py).
``GatedP2P`` is hivemind's ``P2P`` whose DHT handlers first ask whether the caller is
admitted (p2p/admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import Awaitable, Callable

from hivemind.p2p import P2P

_PR_SET_PDEATHSIG = 1


# Runs as the child's first program: a fresh, single-threaded process, where prctl is safe (a
# ``preexec_fn`` would run Python in a fork of a threaded process, deadlock-prone). It asks for
# SIGKILL when the node dies, gives up if the node is already gone, leaves the node's process
# group (a Ctrl-C in the terminal, or torch.distributed.run stopping a rank's group, must reach
# the node, which stops its children itself after its last words to the swarm; a session
# leader such as a rank stays where it is), and becomes the program.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGKILL)})\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "try:\n"
    "    os.setpgid(0, 0)\n"
    "except OSError:\n"
    "    pass\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_us(program: str, *args: str) -> tuple[str, ...]:
    """The command line that runs ``program args`` as a child that dies with this process."""
    return (sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), program, *args)


# p2pd's TCP transport dials from its listen port (SO_REUSEPORT) unless told otherwise. Two peers
# that dial each other at once then send SYNs with the same 4-tuple: TCP merges them into one
# simultaneous open, both ends start the security handshake as its initiator, and it fails
# ("noise: message is too short"); the address then sits in libp2p's dial backoff. At LAN
# round-trip times the window is microseconds; at 200 ms it failed 8 dials of 8. Dialling from
# an ephemeral port makes two crossing dials two connections, both of which work. The listen
# port only matters to a dial for TCP hole punching, which this p2pd does not do.
P2PD_ENVIRONMENT = {"LIBP2P_TCP_REUSEPORT": "false"}


@contextlib.contextmanager
def children_die_with_us():
    """hivemind starts p2pd with create_subprocess_exec and offers no hook; add one (which also
    sets ``P2PD_ENVIRONMENT``)."""
    original = asyncio.subprocess.create_subprocess_exec

    async def spawn(program, *args, **kwargs):
        kwargs["env"] = {**(kwargs.get("env") or os.environ), **P2PD_ENVIRONMENT}
        return await original(*dying_with_us(str(program), *map(str, args)), **kwargs)

    asyncio.subprocess.create_subprocess_exec = spawn
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original


class GatedP2P(P2P):
    """hivemind's P2P whose DHT RPC handlers first ask ``gate(caller's peer id)``.

    hivemind registers its DHT handlers (``DHTProtocol.rpc_ping/store/find``) inside
    ``DHTNode.create``; gating them here means an outsider is refused from the first
    request on, before the handler parses, stores or answers anything."""

    gate: Callable[[str], Awaitable[bool]] | None = None

    async def add_protobuf_handler(self, name, handler, input_protobuf_type, **kwargs) -> None:
        if name.startswith("DHTProtocol."):
            handler = self._gated(handler)
        await super().add_protobuf_handler(name, handler, input_protobuf_type, **kwargs)

    def _gated(self, handler):
        async def gated(request, context):
            if self.gate is not None and not await self.gate(context.remote_id.to_base58()):
                raise PermissionError("not admitted to this swarm")
            return await handler(request, context)

        return gated
