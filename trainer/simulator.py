"""k DiLoCo workers in one process, averaging through an InProcessGroup.

Each simulated peer runs the node's own round function (``trainer.round.PeerRounds``,
what ``node/loop.py`` runs over the swarm) with the network replaced by the
in-process averager, so convergence and failure handling measured here in seconds
are the swarm's. A test runs one seed through a two-node swarm and through this
simulator and compares θ bit for bit (tests/integration/test_simulator_matches.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

import torch

from trainer.averaging import Averager, Combine, HostileMember, InProcessGroup, weighted_average
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.diloco import DiLoCoWorker, InnerStats
from trainer.round import BEHIND, COMMITTED, PeerRounds


class SimulatedPeer:
    """``PeerRounds``' host for simulated peer ``index``: ``steps`` inner steps per round on a
    thread of its own, the group member as the averager, and a re-sync that waits for the others
    to commit and copies their state (as a swarm peer waits for the round in flight and downloads)."""

    def __init__(self, sim: "Simulator", index: int) -> None:
        self.sim = sim
        self.index = index
        self.worker = sim.workers[index]
        self.member = sim.members[index]
        self.stop_requested = asyncio.Event()
        self.steps = 0
        self.stats: InnerStats | None = None
        self.rounds = PeerRounds(self.worker, self, retry_seconds=0.0)

    async def compute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # A thread, as the node's trainer thread: a step waiting to land an average
        # (outer.land_step) must not block the event loop that completes the round.
        threads = self.sim.threads

        def call():
            torch.set_num_threads(threads)  # per thread, as the node's --threads sets its trainer thread's
            return fn(*args, **kwargs)

        return await asyncio.to_thread(call)

    async def train(self, round_step: int) -> InnerStats:
        return await self.compute(self.worker.inner_steps, self.steps - round_step)

    def trained(self, stats: InnerStats, phase_round: int) -> None:
        self.stats = stats

    def waited(self, seconds: float) -> None:
        pass

    async def starting(self) -> None:
        pass

    def delta_target(self) -> torch.Tensor | None:
        return None

    async def average(self, delta, weight: float, round: int):
        avg = await self.member.average(delta, weight, round)
        # In process, a member left out is never asked again: the others committed without it.
        return (avg, COMMITTED, None) if avg is not None else (None, BEHIND, "left out")

    async def before_outer_step(self) -> None:
        pass  # in-process workers check nobody

    async def committed(self, weight: float, overlapped: bool) -> None:
        async with self.sim.commits:
            self.sim.commits.notify_all()

    async def boundary(self) -> None:
        pass

    async def check_consistency(self) -> None:
        pass

    async def resync(self, reason: str) -> None:
        """Overlapped, the others' next round is already in flight: sit it out (its average
        arrives without this peer's work) and take the state after it, as a swarm peer waits
        for the round in flight to commit before it downloads."""
        target = self.worker.round + 1
        if self.rounds.overlapped:
            await self.sim.group.sit_out(self.index, self.worker.round + 1)
            target += 1
        donor = await self.sim.committed_to(target)
        await self.compute(self.worker.load_global_state, donor.global_state())
        self.rounds.round_step = 0

    def done(self) -> bool:
        return False


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
        combine: Combine = weighted_average,
        hostile: tuple[int, str] | None = None,
        shard_keys: list[str] | None = None,
        threads: int = 0,
    ) -> None:
        """``wrap(i, member)`` may replace worker i's averager, e.g. to compress on the way.

        Overlapped rounds: the average of round r lands after this fraction of round
        r+1's inner steps (an all-reduce that takes half a round: 0.5; 1.0 = at the end),
        i.e. at the fixed ``outer.land_step`` that makes a node's overlapped run reproducible.

        ``combine``: the members' (tensors, weight) in member order -> the round's result: the
        exact mean by default, or the swarm's part owners' code (``p2p.compression.SwarmAverage``),
        handed in by the caller (trainer/ imports nothing from the network layer).
        ``fail``: (worker, round) pairs left out of that round's average (round = θ's round when it
        was sent); every round keeps at least one member.
        ``hostile=(i, kind)``: worker i sends ``trainer.averaging.attack(kind)`` of its
        pseudo-gradient, as the part owners receive it (a ``wrap`` codec's errors and
        error feedback stay the worker's own; the hostile values are not quantised).
        ``shard_keys``: each worker's data shard (default ``sim-i``; a node's is its peer id).
        ``threads``: torch intra-op threads of each worker's inner steps, as the node's ``--threads``
        (a matrix product's bits may depend on the count); 0: torch's threads shared among the
        workers, whose steps run side by side."""
        keys = shard_keys if shard_keys is not None else [f"sim-{i}" for i in range(k)]
        if len(keys) != k:
            raise ValueError(f"shard_keys: expected {k} keys (got {len(keys)})")
        # One seed for all: every worker starts from the same θ, as peers do.
        workers = [DiLoCoWorker(model=model, data=data, inner=inner, outer=outer, corpus=corpus, shard_key=key,
                                seed=seed) for key in keys]
        self._setup(workers, fail=fail, wrap=wrap, land_after=land_after, combine=combine, hostile=hostile,
                    threads=threads)

    @classmethod
    def of(cls, workers: list[DiLoCoWorker], **options: Any) -> "Simulator":
        """A simulator over workers built elsewhere (all from the same θ); ``options`` as above."""
        sim = cls.__new__(cls)
        sim._setup(workers, **options)
        return sim

    def _setup(self, workers: list[DiLoCoWorker], *, fail=frozenset(), wrap=None, land_after: float = 1.0,
               combine: Combine = weighted_average, hostile: tuple[int, str] | None = None,
               threads: int = 0) -> None:
        k = len(workers)
        if not 0.0 <= land_after <= 1.0:
            raise ValueError(f"land_after must be in [0, 1], got {land_after}")
        if hostile is not None and not 0 <= hostile[0] < k:
            raise ValueError(f"hostile member must be in [0, {k}) (got {hostile[0]})")
        if any(sum(1 for _, r in fail if r == rnd) >= k for _, rnd in fail):
            raise ValueError("fail: every round needs at least one member that is not left out")
        self.land_after = land_after
        self.threads = threads or max(1, torch.get_num_threads() // k)
        self.workers = workers
        self.overlap = workers[0].outer_cfg.overlap != "off"
        self._land_step = workers[0].outer_cfg.land_step
        self.group = InProcessGroup(k, fail=fail, combine=combine)
        self.members: list[Averager] = [self.group.member(i) for i in range(k)]
        if hostile is not None:
            i, kind = hostile
            self.members[i] = HostileMember(self.members[i], kind)
        if wrap is not None:
            self.members = [wrap(i, m) for i, m in enumerate(self.members)]
        self.peers = [SimulatedPeer(self, i) for i in range(k)]
        self.commits: asyncio.Condition | None = None  # notified on every commit; one per run (its loop)

    def assign_data(self, run_key: str) -> None:
        """Every worker draws its batches by ``run_key``, as a node does once it knows its run's
        fingerprint digest (trainer/data.py); until then they draw by the seed. A simulator that
        must train on a swarm's data is given the swarm's key (node.daemon.fingerprint_terms)."""
        for w in self.workers:
            w.assign_data(run_key)

    async def committed_to(self, round: int) -> DiLoCoWorker:
        """A worker whose θ is at ``round`` (waits for one to commit it)."""
        def donor() -> DiLoCoWorker | None:
            return next((w for w in self.workers if w.round == round), None)

        async with self.commits:
            return await self.commits.wait_for(donor)

    def _prepare_run(self, steps: int) -> None:
        # The fraction land_after of the steps runs before the average lands: at step K+1 of the flight.
        land_step = round(self.land_after * steps) + 1 if self.overlap else self._land_step
        for w, p in zip(self.workers, self.peers):
            if w.outer_cfg.land_step != land_step:
                w.outer_cfg = dataclasses.replace(w.outer_cfg, land_step=land_step)
            p.steps = steps
            p.stop_requested = asyncio.Event()  # of this run's event loop (run_sync starts one each time)
        self.commits = asyncio.Condition()

    async def run(self, rounds: int, steps: int) -> list[dict]:
        """``rounds`` outer rounds of ``steps`` inner steps each per worker; one record per
        round (overlapped: the round whose steps ran, the average of the one before settled)."""
        self._prepare_run(steps)
        per_peer = await asyncio.gather(*(self._peer_rounds(p, rounds) for p in self.peers))
        records = []
        for n in range(rounds):
            rows = [per_peer[i][n] for i in range(len(self.peers))]
            records.append({
                "round": rows[0]["round"],
                "mean_loss": sum(r["loss"] for r in rows) / len(rows),
                "eval_loss": rows[0]["eval_loss"],
                "hashes": [r["hash"] for r in rows],
                "committed": [r["committed"] for r in rows],
            })
        return records

    async def _peer_rounds(self, peer: SimulatedPeer, rounds: int) -> list[dict]:
        out = []
        for _ in range(rounds):
            outcome = await peer.rounds.one_round()
            w = peer.worker
            out.append({"round": w.round, "loss": peer.stats.mean_loss, "hash": w.params_hash(),
                        # Overlapped, the first round has no average settled yet.
                        "committed": outcome != BEHIND,
                        "eval_loss": await peer.compute(w.eval_loss) if peer.index == 0 else None})
        return out

    async def finish(self) -> list[str | None]:
        """Overlapped runs: the last round's average applied on every worker, local copies from θ."""
        return list(await asyncio.gather(*(p.rounds.finish(wait=True) for p in self.peers)))

    def run_sync(self, rounds: int, steps: int) -> list[dict]:
        """``rounds`` rounds, then (overlapped runs) the last average applied everywhere."""

        async def both():
            records = await self.run(rounds, steps)
            if self.overlap:
                await self.finish()
            return records

        return asyncio.run(both())

