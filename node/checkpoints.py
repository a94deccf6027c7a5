"""The node's checkpoints: the one it resumes from at start, one after each commit and at stop.

A checkpoint carries everything a resumed run needs to be the same run: the run id
and fingerprint, the worker's state (θ, outer momentum, inner optimizer, data position),
the round step, the error-feedback residual and the chain of commit certificates.
Beside it, every save rewrites the ledger file (``ledger.jsonl``, p2p/ledgerfile.py): the
chain's certificates that hold, with their ledger entries, for other systems to read.
trainer/checkpoint.py owns the files (written atomically; a multi-rank host's are
numbered parts, one per rank, made the latest only when all are written); this class
owns what goes into them and when. The daemon (node/daemon.py) hands it the training
loop once there is one, so the interface is ``load``, ``restore`` and ``save``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from node.errors import UsageError

log = logging.getLogger("gonka.node")


class NodeCheckpoints:
    """Checkpoints of one node in ``directory`` (node.checkpoint_dir; "" keeps none)."""

    def __init__(self, directory: str, run_id: str, world: int) -> None:
        self.directory = directory
        self.run_id = run_id
        self.world = world  # host.nproc_per_node: with several ranks, every rank writes its part
        self.seq = 0  # a multi-rank host's checkpoints are numbered (trainer/checkpoint.py)

    @property
    def enabled(self) -> bool:
        return bool(self.directory)

    def load(self) -> dict | None:
        """The checkpoint to resume from: the host's (rank 0's part of it, every part checked
        present and of one round) or the single process's; UsageError if it is another run's.
        Reads files: call it off the event loop."""
        from trainer.checkpoint import host_checkpoint, load_checkpoint, load_host_part

        if self.world == 1:
            checkpoint = load_checkpoint(self.directory)
        else:
            pointer = host_checkpoint(self.directory, self.world)
            if pointer is not None:
                self.seq = pointer["seq"]
            checkpoint = load_host_part(self.directory, 0, self.world)
        if checkpoint is not None and checkpoint.get("run_id") != self.run_id:
            raise UsageError(f"node.checkpoint_dir: holds run {checkpoint.get('run_id')!r}, not {self.run_id!r}")
        return checkpoint

    @staticmethod
    def check_fingerprint(checkpoint: dict, fingerprint) -> None:
        """UsageError if ``checkpoint`` was written by a run with another fingerprint
        (trainer/fingerprint.py): a different model, data or rules under the same run id."""
        if checkpoint.get("fingerprint") not in (None, fingerprint.parts):
            raise UsageError(f"node.checkpoint_dir: holds a checkpoint of another run: "
                             f"{fingerprint.difference(checkpoint['fingerprint'])}")

    @staticmethod
    def load_worker(worker, checkpoint: dict) -> None:
        """The worker's state from ``checkpoint`` into ``worker`` (trainer/diloco.py); what does not
        fit is the user's node.checkpoint_dir: ValueError naming it."""
        try:
            worker.load_state_dict(checkpoint["worker"])
        except ValueError as e:
            raise ValueError(f"node.checkpoint_dir: {e}") from None

    def restore(self, checkpoint: dict, loop, *, worker_loaded: bool = False) -> None:
        """Put ``checkpoint`` into the training loop (node/loop.py) and its round protocol: the
        worker's state (unless ``worker_loaded``: a multi-rank host's ranks load theirs together
        as they build), the round step, the error-feedback residual and the certificate chain.
        What does not fit this node is the user's node.checkpoint_dir: ValueError naming it."""
        worker, rounds = loop.worker, loop.rounds
        try:
            if not worker_loaded:
                worker.load_state_dict(checkpoint["worker"])
            loop.round_step = int(checkpoint.get("round_step", 0))
            numel = sum(p.numel() for p in worker.global_params)
            feedback = rounds.ensure_feedback(numel)
            if feedback is not None and checkpoint.get("feedback") is not None:
                feedback.load_state_dict(checkpoint["feedback"])
            if checkpoint.get("commits") is not None:
                rounds.commits.load_state_dict(checkpoint["commits"])
        except ValueError as e:
            raise ValueError(f"node.checkpoint_dir: {e}") from None
        rounds.commits.hold(worker.round, worker.params_hash())
        log.info("resumed from %s at round %d (inner step %d)", self.directory, worker.round, worker.inner_step)

    async def save(self, loop, ranks=None, *, final: bool = False) -> None:
        """Write the training loop's state: this process's, or (``ranks``, node/ranks.py) every
        rank's part. A failure leaves the previous checkpoint in use and is retried at the next
        commit; a ``final`` one (at stop, no next commit) raises."""
        if not self.enabled:
            return
        from p2p.ledgerfile import ledger_certificates
        from trainer.checkpoint import save_checkpoint

        worker, metrics = loop.worker, loop.metrics
        started = time.monotonic()
        feedback = loop.rounds.feedback
        # An average that has not landed lands first, on every rank at once (node/ranks.py).
        await asyncio.to_thread(worker.land)
        # The worker's state is copies of every tensor: taken off the event loop (under the
        # worker's lock, so an outer step in flight is in it entirely or not at all).
        worker_state = await asyncio.to_thread(worker.state_dict)
        state = {"run_id": self.run_id, "round_step": loop.round_step,
                 "fingerprint": loop.swarm.fingerprint.parts if loop.swarm.fingerprint else None,
                 "model": worker.model_info(),
                 "worker": worker_state,
                 "feedback": feedback.state_dict() if feedback is not None else None,
                 "commits": loop.rounds.commits.state_dict()}
        # The ledger file's certificates, copied here on the event loop that adds signatures to them.
        ledger = ledger_certificates(loop.rounds.commits)
        try:
            if ranks is None:
                await asyncio.to_thread(save_checkpoint, self.directory, state)
            else:
                await self._save_host(state, ranks)
        except (OSError, RuntimeError) as e:  # written atomically: the previous checkpoint is intact; retried next commit
            metrics.checkpoint_failures.inc()
            if final:  # no next commit: stopping says so
                raise
            log.error("checkpoint failed, the previous one stays in use: %s", e)
            return
        await self._write_ledger(ledger)
        metrics.checkpoints.inc()
        metrics.checkpoint_seconds.observe(time.monotonic() - started)

    async def _write_ledger(self, certs) -> None:
        """The ledger file beside the checkpoint (p2p/ledgerfile.py, docs/ledger.md), rewritten whole
        and atomically: ~1.2 KB per member per round with its signature (RSA-2048 keys, 1.16 KB
        measured), so 1000 rounds of 8 members are ~9 MB and ~0.15 s of one thread, off the event
        loop, next to a checkpoint of the model. It is derived from the checkpoint's chain: a
        failure is logged and the next checkpoint writes it again."""
        from p2p.ledgerfile import FILE_NAME, write_ledger

        try:
            await asyncio.to_thread(write_ledger, os.path.join(self.directory, FILE_NAME), certs)
        except OSError as e:
            log.error("ledger file not written: %s", e)

    async def _save_host(self, state: dict, ranks) -> None:
        """Every rank writes its part of checkpoint ``seq`` at once; rank 0 makes it the latest
        only when all are written (a rank that cannot write fails the checkpoint, RuntimeError)."""
        from trainer.checkpoint import commit_host_checkpoint, save_host_part

        self.seq += 1
        seq = self.seq
        others = asyncio.ensure_future(ranks.request("checkpoint", dir=self.directory, seq=seq))
        try:
            await asyncio.to_thread(save_host_part, self.directory, seq, 0, state)
        finally:
            await asyncio.gather(others, return_exceptions=True)
        others.result()
        await asyncio.to_thread(commit_host_checkpoint, self.directory, seq, ranks.world, state["worker"]["round"])
