"""The node's side of the checks of sampled members' updates (p2p/checks.py decides who checks
whom and keeps the records; trainer/check.py measures the loss): run between a round's commit
and its outer step (``TrainingLoop.before_outer_step``), record each verdict, sign and send it."""

from __future__ import annotations

import asyncio
import logging
import time

from p2p.checks import CHECK_WINDOWS
from trainer.check import update_gains

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
        own, started = None, time.perf_counter()
        self.loop.set_state("checking")  # one round behind for a moment: the gather waits for us
        for sampled in checks.tasks():
            if self.loop.stop_requested.is_set():  # the commit is applied whatever happens: skip the rest
                break
            update = await checks.fetched(sampled)
            gains: tuple[float, ...] = ()
            if update is not None:
                if own is None:
                    own = await asyncio.to_thread(checks.own_update)
                gains = await self.loop.compute(self._gains, sampled, update, own)
            record = checks.sign(sampled, gains)
            self.loop.metrics.checks.labels(verdict="+".join(record.flags) or "ok").inc()
            log.info("check round=%d of %s: gains=%s flags=%s (%.2fs)", record.round, sampled[-8:],
                     "/".join(f"{g:.4f}" for g in gains) or "-", "+".join(record.flags) or "none",
                     time.perf_counter() - started)
            await checks.publish(record)
        self.loop.metrics.scoring_seconds.labels(part="check").inc(time.perf_counter() - started)

    def _gains(self, sampled: str, update, own) -> tuple[float, ...]:
        """(assigned, control, reference assigned, reference control): the loss ``update`` removes
        on the last CHECK_WINDOWS windows ``sampled`` claims to have trained and on CHECK_WINDOWS
        windows the beacon chose, and what our own update removes on ours and on those."""
        checks, sampler = self.loop.rounds.checks, self.loop.worker.sampler
        rnd, seq = checks.last.round, self.loop.worker.seq_len

        def trained(peer: str) -> range:
            n = int(checks.claimed(peer) // seq)
            return range(max(0, n - CHECK_WINDOWS), n)

        batches = [sampler.stream_batches(sampled, rnd, trained(sampled)),
                   sampler.stream_batches(self.loop.swarm.peer_id, rnd, trained(self.loop.swarm.peer_id)),
                   sampler.stream_batches(f"control/{checks.beacon.hex()}", rnd, range(CHECK_WINDOWS))]
        gains = update_gains(self.loop.worker, [update, own], batches)
        return (gains[0][0], gains[0][2], gains[1][1], gains[1][2])
