"""Whether other peers can dial this node: asked of them, answered with a TCP connect.

A host behind NAT (or a firewall that drops what it did not ask for) can dial
out but cannot be dialled. libp2p uses a connection both ways, so such a peer
still exchanges with every peer it dialled itself; what it cannot do is meet
a peer that has no connection to it and cannot open one (another peer behind
NAT). An operator needs to know which case a host is in, and the round needs
to know it before it can route around it (docs/wan.md).

A node finds out from its peers: it asks up to ``ASKED`` of them to dial it
back (``check``). The request carries nothing: a peer that is asked dials
only the TCP addresses of the asker's own signed heartbeat (at most
``MAX_ADDRESSES``, ``DIAL_TIMEOUT`` each, once per asker and addresses per
``MIN_INTERVAL``: a peer restarted on new addresses is dialled at once, the same
question again gets no answer), so it cannot be made to probe anybody else, and it
answers whether one of them accepted a connection (``on_dialback``). A
connect, then a close: nothing is sent. Peers may lie, so the answers decide
by strict majority (``verdict``); with none, the answer stays unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import re
import time
from typing import Awaitable, Callable

from p2p.limits import BoundedDict
from p2p.wire import reply

log = logging.getLogger(__name__)

ASKED = 3  # peers asked each time
MAX_ADDRESSES = 4  # of the asker's addresses, dialled back
DIAL_TIMEOUT = 5.0  # seconds for one TCP connect (20 round trips at 250 ms)
MIN_INTERVAL = 30.0  # seconds between two dial-backs of one asker's same addresses
CHECK_INTERVAL = 600.0  # seconds between two checks of a node that knows its answer
# The most a node that checks waits for its first answer before its first round: a round formed
# before its members know who can be dialled gives parts to peers behind NAT, and fails when two
# of them must meet (docs/wan.md). A dial-back to a NAT'd host takes DIAL_TIMEOUT per address.
SETTLE_SECONDS = 30.0
_TCP = re.compile(r"/(ip4|ip6)/([^/]+)/tcp/(\d+)(?:/|$)")


def tcp_endpoints(maddrs) -> list[tuple[str, int]]:
    """The (host, port) of each /ip4 or /ip6 TCP multiaddr, at most ``MAX_ADDRESSES``, in order."""
    out = []
    for addr in maddrs:
        m = _TCP.match(addr) if isinstance(addr, str) else None
        if m is None:
            continue
        try:
            host = str(ipaddress.ip_address(m.group(2)))
        except ValueError:
            continue
        port = int(m.group(3))
        if 0 < port < 65536 and (host, port) not in out:
            out.append((host, port))
        if len(out) == MAX_ADDRESSES:
            break
    return out


def verdict(answers: list[bool]) -> bool | None:
    """Reachable if a strict majority of the answers say a connect succeeded; None without answers."""
    if not answers:
        return None
    return 2 * sum(answers) > len(answers)


async def _connects(host: str, port: int, timeout: float) -> bool:
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


class Reachability:
    """This node's answer (``reachable``: True, False or None for unknown) and its side of others' checks."""

    def __init__(self, swarm, call: Callable[..., Awaitable], request_timeout: float) -> None:
        """``call(peer, header, timeout)``: send a dial-back request, return (reply header, payload)."""
        self.swarm = swarm
        self._call = call
        self.request_timeout = request_timeout
        self.reachable: bool | None = None
        self.checking = False  # set by whoever runs ``check`` (the node); see ``settled``
        self._answered = asyncio.Event()
        self._dialled_for = BoundedDict(4096)  # (asker, endpoints) -> when we last dialled them

    async def check(self) -> bool | None:
        """Ask up to ``ASKED`` peers of the table to dial us back; set and return ``reachable``."""
        candidates = [p for p, r in self.swarm.peers.items() if p != self.swarm.peer_id and r.maddrs]
        asked = random.sample(candidates, min(ASKED, len(candidates)))

        async def ask(peer: str) -> bool | None:
            try:
                header, _ = await self._call(peer, {}, DIAL_TIMEOUT * MAX_ADDRESSES + self.request_timeout)
            except Exception as e:  # a peer that does not answer tells us nothing
                log.debug("dial-back request to %s failed: %r", peer[-8:], e)
                return None
            ok = header.get("ok")
            return ok if isinstance(ok, bool) else None

        answers = [a for a in await asyncio.gather(*(ask(p) for p in asked)) if a is not None]
        found = verdict(answers)
        if found is not None:
            if found != self.reachable:
                log.info("%s from outside (%d of %d peers dialled back)",
                         "reachable" if found else "NOT reachable", sum(answers), len(answers))
            self.reachable = found
            self.swarm.announce(dial=found)  # in our heartbeat: a leader gives parts to dialable peers
            self._answered.set()
        return self.reachable

    async def settled(self, timeout: float = SETTLE_SECONDS) -> bool | None:
        """Wait (at most ``timeout``) for the first answer, if a check runs and there are peers to
        ask; returns ``reachable``. A node alone, or one that does not check, does not wait."""
        if self.checking and self.reachable is None and self.swarm.peers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._answered.wait()
        return self.reachable

    async def stay_connected(self) -> int:
        """Behind NAT: dial every peer whose heartbeat says it accepts dials and that p2pd holds no
        connection to, so that leaders and owners can reach us over ours (they cannot dial us);
        returns how many were dialled. One connection per dialable peer, kept by p2pd."""
        connected = {info.peer_id.to_base58() for info in await self.swarm.p2p.list_peers()}
        missing = [p for p, r in self.swarm.peers.items()
                   if r.reachable is True and p != self.swarm.peer_id and p not in connected]
        await asyncio.gather(*(self.swarm.connect_to(p) for p in missing))
        return len(missing)

    async def run(self, heartbeat_interval: float, on_change: Callable[[bool], None] | None = None) -> None:
        """Check, for as long as the node runs: as soon as the table shows a peer, again while
        nobody has answered, then every ``CHECK_INTERVAL``; behind NAT, keep a connection to each
        dialable peer in between (``stay_connected``). ``on_change(found)`` hears each new answer."""
        self.checking = True
        while True:
            if not self.swarm.peers:
                await asyncio.sleep(heartbeat_interval)
                continue
            before = self.reachable
            try:
                found = await self.check()
            except Exception as e:  # the check informs the operator and the leader; it never stops the node
                log.debug("reachability check failed: %r", e)
                found = None
            if found is not None and found != before and on_change is not None:
                on_change(found)
            if found is not False:
                await asyncio.sleep(CHECK_INTERVAL if found else 3 * heartbeat_interval)
                continue
            until = time.monotonic() + CHECK_INTERVAL  # until the next check
            while time.monotonic() < until:
                try:
                    await self.stay_connected()
                except Exception as e:  # p2pd busy or restarting: next heartbeat
                    log.debug("keeping connections failed: %r", e)
                await asyncio.sleep(heartbeat_interval)

    async def on_dialback(self, sender: str, header: dict, reader, writer) -> None:
        """A peer asks whether we can dial it: try the addresses of its signed heartbeat."""
        now = time.monotonic()
        record = self.swarm.peers.get(sender)
        endpoints = tuple(tcp_endpoints(record.maddrs)) if record is not None else ()
        last = self._dialled_for.get((sender, endpoints))
        if (last is not None and now - last < MIN_INTERVAL) or record is None:
            await reply(writer, {"ok": None})  # no answer: asked that too soon, or a peer we do not know
            return
        self._dialled_for[(sender, endpoints)] = now
        ok = False
        for host, port in endpoints:
            if await _connects(host, port, DIAL_TIMEOUT):
                ok = True
                break
        await reply(writer, {"ok": ok})
