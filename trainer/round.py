"""One peer's DiLoCo rounds: the round function the node and the simulator both run.

``PeerRounds.one_round`` is the algorithm of docs/design.md as one peer sees it:
inner steps, pseudo-gradient, average, outer step; or, with rounds overlapping,
the average of round r travelling while round r+1's inner steps run. What
differs between a swarm peer and a simulated one is behind ``RoundHost``: where
the inner steps run and for how long, how the average is reached (the swarm's
round protocol over libp2p, or an in-process group), how a peer left behind
re-syncs, and what it records. The node's host is ``node/loop.py``'s
``TrainingLoop``; the simulator's is ``trainer/simulator.py``'s ``SimulatedPeer``.
A test runs the same seed through both and compares θ bit for bit
(tests/integration/test_simulator_matches.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Protocol

import torch

from trainer.diloco import DiLoCoWorker, InnerStats

log = logging.getLogger("gonka.round")

# An aborted round is tried again with the survivors after this long.
RETRY_SECONDS = 0.5

COMMITTED, BEHIND, ABORTED = "committed", "behind", "aborted"


class RoundHost(Protocol):
    """What a peer's rounds ask of whoever runs them."""

    stop_requested: asyncio.Event

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one of the worker's blocking calls where its inner steps run."""

    async def train(self, round_step: int) -> InnerStats:
        """This round's inner steps (``round_step`` of them were taken already, after a resume)."""

    def trained(self, stats: InnerStats, phase_round: int) -> None:
        """Record a phase of inner steps towards round ``phase_round``."""

    def waited(self, seconds: float) -> None:
        """Overlapped rounds: the steps were done this long before the round in flight settled."""

    async def starting(self) -> None:
        """A phase of inner steps begins with no round in flight."""

    def delta_target(self) -> torch.Tensor | None:
        """A vector the pseudo-gradient is added into (error feedback's residual), or None."""

    async def average(self, delta: list[torch.Tensor], weight: float, round: int
                      ) -> tuple[list[torch.Tensor] | None, str, str | None]:
        """One attempt at the round's average: (average, COMMITTED, None), or (None, BEHIND, why)
        when the others committed without us, or (None, ABORTED, why): try again."""

    async def before_outer_step(self) -> None:
        """A round committed and no round overlaps: θ is still the round's start (a node checks
        sampled members' updates here, p2p/checks.py)."""

    async def committed(self, weight: float, overlapped: bool) -> None:
        """After the outer step: the host's bookkeeping (metrics, state published, certificate)."""

    async def boundary(self) -> None:
        """Overlapped rounds: the previous round committed and this round's steps are done."""

    async def check_consistency(self) -> None:
        """Before this peer sends its work: re-sync if the others hold another state."""

    async def resync(self, reason: str) -> None:
        """Replace the global state with the swarm's; sets ``PeerRounds.round_step`` to 0 if it did."""

    def done(self) -> bool:
        """No further round is to be sent (the run's last round committed, or a stop)."""


class PeerRounds:
    """One peer's rounds over a ``DiLoCoWorker``, plain or overlapped (``outer.overlap``)."""

    def __init__(self, worker: DiLoCoWorker, host: RoundHost, *, retry_seconds: float = RETRY_SECONDS) -> None:
        self.worker = worker
        self.host = host
        self.retry_seconds = retry_seconds
        # Inner steps already taken in the current round (non-zero after resuming mid-round).
        self.round_step = 0
        # Overlapped rounds: the previous round's averaging, running during these inner steps,
        # and its number (as its commit numbers it).
        self.pending: asyncio.Future | None = None
        self.in_flight = 0
        self._committing: asyncio.Future | None = None  # the commit being applied (see commit)

    @property
    def overlapped(self) -> bool:
        return self.worker.outer_cfg.overlap != "off"

    async def one_round(self) -> str | None:
        """Inner steps, then this round's average: awaited (overlap off) or launched in the
        background while the next round's inner steps run (delayed, eager).

        Returns how the round that settled here ended: COMMITTED or BEHIND (and re-synced),
        or None (stopping; or overlapped, the first round, whose average is still in flight)."""
        host, worker = self.host, self.worker
        if self.pending is None:
            await host.starting()
        # The round these steps count towards: the next one, or the one after the round in flight
        # (by its number, not θ's: the round in flight may have committed while we were away).
        # They train on that round's assigned data, from the step the round is at.
        phase_round = worker.round + 1 if self.pending is None else self.in_flight + 1
        worker.train_for(phase_round, self.round_step)
        stats = await host.train(self.round_step)
        self.round_step += stats.steps
        host.trained(stats, phase_round)
        if host.stop_requested.is_set():
            return None
        outcome = None
        if self.pending is not None:
            waited = time.monotonic()
            outcome = await self.unless_stopped(self.pending)
            self.pending = None
            host.waited(time.monotonic() - waited)
            if outcome is None:
                return None
            if outcome == BEHIND:
                await host.resync(BEHIND)
                return outcome
            await host.boundary()
            if host.done():  # the run's last round: the work of this last phase is not sent
                return outcome
        await host.check_consistency()
        if self.round_step == 0:  # a re-sync discarded this round's work
            return outcome
        into = host.delta_target()
        delta = await host.compute(worker.pseudo_gradient, into)
        # Weight = tokens this peer trained on in the round (DiLoCo's token-weighted average).
        weight = float(self.round_step * worker.tokens_per_step)
        if not self.overlapped:
            outcome = await self.average_until_settled(delta, weight)
            if outcome == BEHIND:
                await host.resync(BEHIND)
            return outcome
        # Δ alone (error feedback's vector holds more: the worker computes Δ again from the copy).
        await host.compute(worker.start_overlapped, delta if into is None else None)
        self.round_step = 0
        self.in_flight = worker.round + 1
        self.pending = asyncio.ensure_future(self.average_until_settled(delta, weight))
        # Committed (the average already applied), behind, or stopping: a step waiting for it goes on.
        self.pending.add_done_callback(lambda _: worker.settle())
        return outcome

    async def average_until_settled(self, delta: list[torch.Tensor], weight: float) -> str | None:
        """Average until the round commits (COMMITTED), the swarm moves past us (BEHIND: the
        caller re-syncs), or we are told to stop (None)."""
        r = self.worker.round
        stop = self.host.stop_requested
        while not stop.is_set():
            attempt = await self.unless_stopped(self.host.average(delta, weight, r))
            if attempt is None:
                return None
            avg, status, _ = attempt
            if avg is not None:
                await self.commit(avg, weight)
                return COMMITTED
            if stop.is_set():
                return None
            if status == BEHIND:
                return BEHIND
            await asyncio.sleep(self.retry_seconds)
        return None

    async def commit(self, avg: list[torch.Tensor], weight: float) -> None:
        """Apply the committed average, whatever happens meanwhile: a stop that cancels the
        round in flight waits for it (``finish``) instead of leaving θ between the outer step
        and the host's bookkeeping of it."""
        self._committing = asyncio.ensure_future(self._commit(avg, weight))
        await asyncio.shield(self._committing)

    async def _commit(self, avg: list[torch.Tensor], weight: float) -> None:
        """Overlapped, the inner steps of the next round are running meanwhile: the local copy
        is left alone (it takes the average at ``outer.land_step``), and the outer step runs
        beside those steps (the worker's lock orders the two)."""
        overlapped = self.overlapped
        if not overlapped:
            await self.host.before_outer_step()
        run = asyncio.to_thread if overlapped else self.host.compute
        await run(self.worker.apply_outer, avg, reset_local=not overlapped)
        if not overlapped:
            self.round_step = 0
        await self.host.committed(weight, overlapped)

    async def finish(self, *, wait: bool = False) -> str | None:
        """The round in flight, if any: cancelled (a stop: it aborts everywhere), or awaited
        (``wait``: its average applied, and the local copy restarts from θ). A commit being
        applied always ends first."""
        outcome = None
        if self.pending is not None:
            if wait:
                outcome = await self.pending
                if outcome == COMMITTED:
                    await self.host.compute(self.worker.reset_local)
            else:
                self.pending.cancel()
                await asyncio.gather(self.pending, return_exceptions=True)
            self.pending = None
        if self._committing is not None:
            await asyncio.gather(self._committing, return_exceptions=True)
        return outcome

    async def unless_stopped(self, coro: Awaitable):
        """Run coro, but abandon it (cancel) as soon as a stop is requested (then None)."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self.host.stop_requested.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()  # and let it end now: a peer stopping later must not leave it pending
            await asyncio.gather(stop, return_exceptions=True)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
        return task.result()
