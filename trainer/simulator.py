"""k DiLoCo workers in one process, averaging through an InProcessGroup.

The simulator runs exactly the code a swarm peer runs (``run_round``), with the
network replaced by the in-process averager, so convergence and failure
handling can be measured on one machine in seconds.
"""

from __future__ import annotations

import asyncio

import torch

from typing import Callable

from trainer.averaging import Averager, HostileMember, InProcessGroup, weighted_average
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.diloco import DiLoCoWorker, drain, run_round, run_round_overlapped


class Simulator:
    def __init__(
        self,
        k: int,
        *,
        model: ModelConfig,
        data: DataConfig,
        inner: InnerConfig,
        outer: OuterConfig,
        corpus: torch.Tensor,
        seed: int,
        fail: set[tuple[int, int]] | frozenset = frozenset(),
        wrap: Callable[[int, Averager], Averager] | None = None,
        land_after: float = 1.0,
        aggregator: str | None = None,
        hostile: tuple[int, str] | None = None,
    ) -> None:
        """``wrap(i, member)`` may replace worker i's averager, e.g. to compress on the way.

        Overlapped rounds: the average of round r lands after this fraction of round
        r+1's inner steps (an all-reduce that takes half a round: 0.5; 1.0 = at the end).

        ``aggregator``: None averages exactly (float64); a ``swarm.aggregator`` name runs the
        swarm's part owners' code on the swarm's pieces (``p2p.compression.SwarmAverage``).
        ``hostile=(i, kind)``: worker i sends ``trainer.averaging.attack(kind)`` of its
        pseudo-gradient, as the part owners receive it (a ``wrap`` codec's errors and
        error feedback stay the worker's own; the hostile values are not quantised)."""
        if not 0.0 <= land_after <= 1.0:
            raise ValueError(f"land_after must be in [0, 1], got {land_after}")
        if hostile is not None and not 0 <= hostile[0] < k:
            raise ValueError(f"hostile member must be in [0, {k}) (got {hostile[0]})")
        self.land_after = land_after
        # One seed for all: every worker starts from the same θ, as peers do.
        self.workers = [
            DiLoCoWorker(
                model=model, data=data, inner=inner, outer=outer,
                corpus=corpus, shard_key=f"sim-{i}", seed=seed,
            )
            for i in range(k)
        ]
        self.overlap = outer.overlap != "off"
        self._pending: list[asyncio.Future | None] = [None] * k
        combine = weighted_average
        if aggregator is not None:
            from p2p.compression import SwarmAverage  # pure tensor code, no network

            combine = SwarmAverage(aggregator)
        self.group = InProcessGroup(k, fail=fail, combine=combine)
        self._members = [self.group.member(i) for i in range(k)]
        if hostile is not None:
            i, kind = hostile
            self._members[i] = HostileMember(self._members[i], kind)
        if wrap is not None:
            self._members = [wrap(i, m) for i, m in enumerate(self._members)]

    async def run(self, rounds: int, steps: int) -> list[dict]:
        """``rounds`` outer rounds of ``steps`` inner steps each; one record per round."""
        records = []
        for _ in range(rounds):
            if self.overlap:
                results = await self._overlapped_round(steps)
            else:
                results = await asyncio.gather(
                    *(run_round(w, m, steps) for w, m in zip(self.workers, self._members))
                )
            committed = [ok for _, ok in results]
            self._resync(committed)
            records.append({
                "round": self.workers[0].round,
                "mean_loss": sum(s.mean_loss for s, _ in results) / len(results),
                "eval_loss": self.workers[0].eval_loss(),
                "hashes": [w.params_hash() for w in self.workers],
                "committed": committed,
            })
        return records

    async def _overlapped_round(self, steps: int) -> list[tuple]:
        """Each worker's round r+1 inner steps, then round r's average lands (None = no round yet)."""
        out = await asyncio.gather(*(
            run_round_overlapped(w, m, steps, p, land_after=round(self.land_after * steps))
            for w, m, p in zip(self.workers, self._members, self._pending)
        ))
        self._pending = [p for _, _, p in out]
        return [(stats, True if ok is None else ok) for stats, ok, _ in out]

    async def finish(self) -> list[bool | None]:
        """Overlapped runs: apply the last round's average on every worker."""
        done = await asyncio.gather(*(drain(w, p) for w, p in zip(self.workers, self._pending)))
        self._pending = [None] * len(self.workers)
        return list(done)

    def _resync(self, committed: list[bool]) -> None:
        # A worker that missed a round is one round behind; like a peer in the
        # swarm it downloads the global state from one that committed.
        if all(committed) or not any(committed):
            return
        state = self.workers[committed.index(True)].global_state()
        for i, (worker, ok) in enumerate(zip(self.workers, committed)):
            if not ok:
                worker.load_global_state(state)
                if self.overlap:
                    # The others' next round is already in flight: sit it out, receive its
                    # average, and contribute from the round after (as a re-synced peer does).
                    self._pending[i] = asyncio.ensure_future(self.group.sit_out(i, worker.round))

    def run_sync(self, rounds: int, steps: int) -> list[dict]:
        """``rounds`` rounds, then (overlapped runs) the last average applied everywhere."""

        async def both():
            records = await self.run(rounds, steps)
            if self.overlap:
                await self.finish()
            return records

        return asyncio.run(both())
