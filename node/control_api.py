"""What the node answers on its control socket: `status`, `peers` and `top`.

node/control.py carries the requests (a unix socket, one JSON line each way);
this class is the node's side of them, kept apart from the lifecycle in
node/daemon.py. The socket opens before the swarm does (a node that is still
joining answers `status`), so the swarm is handed over with ``attach`` once it
is up; until then the answers hold this node alone.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from node.metrics import NodeMetrics
from node.status import Status
from p2p.peertable import parse_observed


class ControlAPI:
    """The control commands' handlers, for ``ControlServer(path, api.handlers())``."""

    def __init__(self, status: Status, metrics: NodeMetrics, run_id: str, write_status: Callable[[], None]) -> None:
        self.status = status
        self.metrics = metrics
        self.run_id = run_id
        # Brings the status up to date with the swarm and writes the status file (the daemon's).
        self.write_status = write_status
        self.swarm = None

    def attach(self, swarm) -> None:
        """The swarm is up: answers include its peers."""
        self.swarm = swarm

    def handlers(self) -> dict[str, Callable[[], Awaitable]]:
        return {"status": self.answer_status, "peers": self.peers, "top": self.top}

    async def answer_status(self) -> dict:
        """`gonka-node status`: this node's Status, its peer count fresh."""
        if self.swarm is not None:
            await self.swarm.refresh_peers(max_age=1.0)
        self.write_status()
        return self.status.to_json()

    async def peers(self) -> list[dict]:
        """`gonka-node peers`: our row first, then every live peer's as its heartbeat tells it."""
        peers = await self.swarm.refresh_peers(max_age=1.0) if self.swarm else {}
        self.write_status()
        s = self.status
        me = {"peer_id": s.peer_id, "state": s.state, "round": s.round, "params_hash": s.params_hash,
              "inner_step": s.inner_step, "loss": s.loss, "multiaddrs": s.multiaddrs, "self": True,
              **parse_observed(self.swarm.observed if self.swarm else {})}
        return [me] + [dict(r.to_json(), self=False) for r in peers.values()]

    async def top(self) -> dict:
        """One screen of `gonka-node top`: every peer's row (ours first; the others' as their
        heartbeats tell it) and this node's own counts by reason."""
        return {"peers": await self.peers(), "run_id": self.run_id,
                "aborts": self.metrics.counted("gonka_node_rounds_aborted_total", by="reason"),
                "rejected": self.metrics.counted("gonka_node_rejected_messages_total", by="reason"),
                "quarantined": self.metrics.counted("gonka_node_quarantined_total", by="reason")}
