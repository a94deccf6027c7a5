"""The node's side of the checks of sampled members' updates (p2p/checks.py decides who checks
whom and keeps the records; trainer/check.py measures the loss): run between a round's commit
and its outer step (``TrainingLoop.before_outer_step``), record each verdict, sign and send it."""

from __future__ import annotations

import asyncio
import logging
import time

from p2p.checks import CHECK_WINDOWS
from trainer.check import check_gains, control_windows, trained_windows, yardstick

log = logging.getLogger("gonka.node")


class UpdateChecks:
    """The checks a node's last committed round gave it, run with its training loop's worker."""

    def __init__(self, loop) -> None:
        self.loop = loop  # node/loop.py TrainingLoop: rounds, worker, compute thread, state, metrics

    async def run(self) -> None:
        """The checks the round's beacon gave this node (p2p/checks.py): each sampled member's
        update against its assigned windows, signed and sent to every live peer. Between the
        commit and the outer step, with no round overlapping: θ is still the state the updates
        came from, and the local copy, whose pseudo-gradient was taken, is reset by the outer
        step. Single-rank hosts only: a rank holds only its shard of the update."""
        checks = self.loop.rounds.checks
        if self.loop.worker.ranks is not None or not checks.tasks():
            return
        started = time.perf_counter()
        self.loop.set_state("checking")  # one round behind for a moment: the gather waits for us
        shared: dict | None = None  # this round's yardstick, measured once for every check
        for sampled in checks.tasks():
            if self.loop.stop_requested.is_set():  # the commit is applied whatever happens: skip the rest
                break
            update = await checks.fetched(sampled)
            gains: tuple[float, ...] = ()
            if update is not None:
                if shared is None:
                    own = await asyncio.to_thread(checks.own_update)
                    shared = await self.loop.compute(self._yardstick, own, list(checks.tasks()))
                gains = await self.loop.compute(self._gains, sampled, update, shared)
            record = checks.sign(sampled, gains)
            self.loop.metrics.checks.labels(verdict="+".join(record.flags) or "ok").inc()
            log.info("check round=%d of %s: gains=%s flags=%s (%.2fs)", record.round, sampled[-8:],
                     "/".join(f"{g:.4f}" for g in gains) or "-", "+".join(record.flags) or "none",
                     time.perf_counter() - started)
            await checks.publish(record)
        self.loop.metrics.scoring_seconds.labels(part="check").inc(time.perf_counter() - started)

    def _windows(self, peer: str | None):
        """The last CHECK_WINDOWS windows ``peer`` claims to have trained the round, or the
        beacon's control windows (None)."""
        checks, sampler = self.loop.rounds.checks, self.loop.worker.sampler
        if peer is None:
            return control_windows(sampler, checks.beacon, checks.last.round, CHECK_WINDOWS)
        return trained_windows(sampler, peer, checks.last.round, checks.claimed(peer), self.loop.worker.seq_len,
                               CHECK_WINDOWS)

    def _yardstick(self, own, sampled: list[str]) -> dict:
        me = self.loop.swarm.peer_id
        return yardstick(self.loop.worker, own, self._windows(me), self._windows(None),
                         {p: self._windows(p) for p in sampled})

    def _gains(self, sampled: str, update, shared: dict) -> tuple[float, ...]:
        return check_gains(self.loop.worker, sampled, update, self._windows(sampled),
                           self._windows(self.loop.swarm.peer_id), self._windows(None), shared)
