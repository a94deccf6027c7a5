"""k DiLoCo workers in one process, averaging through an InProcessGroup.

The simulator runs exactly the code a swarm peer runs (``run_round``), with the
network replaced by the in-process averager, so convergence and failure
handling can be measured on one machine in seconds.
"""

from __future__ import annotations

import asyncio

import torch

from typing import Callable

from trainer.averaging import Averager, InProcessGroup
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.diloco import DiLoCoWorker, run_round


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
    ) -> None:
        """``wrap(i, member)`` may replace worker i's averager, e.g. to compress on the way."""
        # One seed for all: every worker starts from the same θ, as peers do.
        self.workers = [
            DiLoCoWorker(
                model=model, data=data, inner=inner, outer=outer,
                corpus=corpus, shard_key=f"sim-{i}", seed=seed,
            )
            for i in range(k)
        ]
        self.group = InProcessGroup(k, fail=fail)
        self._members = [self.group.member(i) for i in range(k)]
        if wrap is not None:
            self._members = [wrap(i, m) for i, m in enumerate(self._members)]

    async def run(self, rounds: int, steps: int) -> list[dict]:
        """``rounds`` outer rounds of ``steps`` inner steps each; one record per round."""
        records = []
        for _ in range(rounds):
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

    def _resync(self, committed: list[bool]) -> None:
        # A worker that missed a round is one round behind; like a peer in the
        # swarm it downloads the global state from one that committed.
        if all(committed) or not any(committed):
            return
        state = self.workers[committed.index(True)].global_state()
        for worker, ok in zip(self.workers, committed):
            if not ok:
                worker.load_global_state(state)

    def run_sync(self, rounds: int, steps: int) -> list[dict]:
        return asyncio.run(self.run(rounds, steps))
