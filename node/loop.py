"""The node's training loop: joining, rounds over the swarm, re-syncs, what others see.

The round itself (inner steps, pseudo-gradient, average, outer step, overlapped or
not) is ``trainer.round.PeerRounds``, the same function the simulator runs; this
module is its host in a swarm: the round protocol over libp2p, inner steps on the
trainer's thread (heavy work never blocks the event loop, which keeps serving the
swarm), state downloads when the swarm moves on, metrics, status and checkpoints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

from node.catchup import catch_up
from node.checking import UpdateChecks
from node.status import Status
from p2p.aggregate import counted_tokens
from p2p.averagelog import RoundAverage
from p2p.compression import CommittedAverage
from p2p.quorum import follow, live_peers
from p2p.rounds import RoundProtocol
from p2p.swarm import Swarm
from p2p.snapshot import Snapshot
from p2p.stateserver import StateServer
from p2p.transfer import NoChain, StateDownload
from trainer.diloco import DiLoCoWorker
from trainer.round import ABORTED, BEHIND, COMMITTED, RETRY_SECONDS, PeerRounds

log = logging.getLogger("gonka.node")

# Re-syncs in a row, each because the swarm committed again during the one before (``resync``).
CATCH_UPS = 3


class RunMismatch(Exception):
    """Every peer this node could reach trains another run under its run id (exit code 2)."""


class TrainingLoop:
    """The node's host for ``trainer.round.PeerRounds``: the round runs over the swarm's round
    protocol (p2p/rounds.py), inner steps on the trainer's thread, and a peer left behind
    downloads the swarm's state."""

    def __init__(self, *, worker: DiLoCoWorker, swarm: Swarm, rounds: RoundProtocol, server: StateServer,
                 compute, metrics, status: Status, inner_steps: int, max_rounds: int, on_commit) -> None:
        self.worker = worker
        self.checking = UpdateChecks(self)  # sampled members' updates, before an outer step (p2p/checks.py)
        # Runs the worker's heavy calls on the trainer's own thread (node/compute.py).
        self.compute = compute
        self.swarm = swarm
        self.rounds = rounds
        self.server = server
        self.metrics = metrics
        self.status = status
        self.inner_steps = inner_steps
        self.max_rounds = max_rounds
        self.on_commit = on_commit  # async callback(checkpoint: bool): checkpoint + status file
        self.stop_requested = asyncio.Event()
        self.stop_flag = threading.Event()  # seen by the inner-step thread
        self.peer = PeerRounds(worker, self)
        self._evaluated = -1
        self._fakes = 0  # test-only hostile states served (p2p/hostile.py, fake_states)
        self.last_commit: dict | None = None  # the last committed round, for the history (node/history.py)
        self._wire_average = None  # the round's average as it came over the wire, kept at its commit

    @property
    def round_step(self) -> int:
        """Inner steps already taken in the current round (non-zero after resuming mid-round)."""
        return self.peer.round_step

    @round_step.setter
    def round_step(self, steps: int) -> None:
        self.peer.round_step = steps

    def request_stop(self) -> None:
        self.stop_flag.set()
        self.stop_requested.set()

    def done(self) -> bool:
        return self.stop_requested.is_set() or (self.max_rounds > 0 and self.worker.round >= self.max_rounds)

    async def run(self) -> None:
        await self.publish_state()
        await self.join()
        try:
            while not self.done():
                await self.peer.one_round()
        finally:
            # Stopping: the round in flight aborts everywhere, unless it was committing.
            await self.peer.finish()

    # ---- the round's host (trainer/round.py) -------------------------------------------------

    async def starting(self) -> None:
        self.set_state("training")
        if self.rounds.hostile.fake_states:  # test-only: a new claim every round, committed or not
            await asyncio.to_thread(self._serve_fake_state)

    async def train(self, round_step: int):
        """This round's inner steps: H of them, or (heterogeneous hosts) until the round's
        wall-clock target or the swarm's token budget for the round is reached."""
        cfg = self.worker.inner_cfg
        if self.rounds.hostile.overclaim:  # test-only: one step, and the tokens of all of them claimed
            stats = await self.compute(self.worker.inner_steps, 1)
            steps = max(self.inner_steps - round_step, stats.steps)
            return dataclasses.replace(stats, steps=steps, tokens=steps * self.tokens_per_step)
        if not (cfg.round_seconds or cfg.round_tokens):
            return await self.compute(self.worker.inner_steps, self.inner_steps - round_step,
                                      self.rounds.faults.paced(self.stop_flag.is_set, self.stop_flag))
        started, first_step = time.monotonic(), self.worker.inner_step
        done_before = round_step * self.tokens_per_step  # resumed mid-round
        swarm_tokens = 0  # other peers' tokens towards the same round, from their heartbeats

        def mine() -> int:
            return done_before + (self.worker.inner_step - first_step) * self.tokens_per_step

        def should_stop() -> bool:
            if self.stop_flag.is_set():
                return True
            if self.worker.inner_step == first_step:
                return False  # every peer contributes at least one step
            if cfg.round_seconds and time.monotonic() - started >= cfg.round_seconds:
                return True
            return bool(cfg.round_tokens) and mine() + swarm_tokens >= cfg.round_tokens

        async def share_progress():
            nonlocal swarm_tokens
            while True:
                self.swarm.announce(rtok=mine(), step=self.worker.inner_step)
                peers = await self.swarm.refresh_peers()
                # Peers on our round train towards the same next round (their claims capped).
                swarm_tokens = counted_tokens([r.round_tokens for r in peers.values() if r.round == self.worker.round],
                                              mine())
                await asyncio.sleep(self.swarm.config.heartbeat_interval / 2)

        monitor = asyncio.ensure_future(share_progress()) if cfg.round_tokens else None
        try:
            stats = await self.compute(self.worker.inner_steps, 1 << 62,
                                       self.rounds.faults.paced(should_stop, self.stop_flag))
        finally:
            if monitor is not None:
                monitor.cancel()
                await asyncio.gather(monitor, return_exceptions=True)
        self.swarm.announce(rtok=mine())
        return stats

    @property
    def overlapped(self) -> bool:
        return self.peer.overlapped

    @property
    def tokens_per_step(self) -> int:
        return self.worker.tokens_per_step

    def waited(self, seconds: float) -> None:
        self.metrics.overlap_wait_seconds.inc(seconds)

    def delta_target(self):
        # Into error feedback's vector where it is free: no vector of Δ alone (the round folds it).
        return self.rounds.delta_target()

    async def average(self, delta, weight: float, round: int):
        avg = await self.rounds.average(delta, weight, round, state=self.status.params_hash, donate=True)
        outcome = self.rounds.last
        if avg is not None:
            if self.server.averages.keep and isinstance(avg, CommittedAverage):
                self._wire_average = avg.wire()  # for joiners that catch up (p2p/averagelog.py)
            return avg, COMMITTED, None
        if outcome.status == "behind":
            return None, BEHIND, outcome.reason
        if not self.stop_requested.is_set():
            self.metrics.rounds_aborted.labels(reason=outcome.reason or "unknown").inc()
            self.metrics.round_retries.inc()
            log.info("aborted round=%d group=%s reason=%s; retrying with the survivors", round + 1, outcome.group_id,
                     outcome.reason)
        return None, ABORTED, outcome.reason

    async def committed(self, weight: float, overlapped: bool) -> None:
        """Overlapped, the inner steps of the next round are running meanwhile: evaluation and
        the checkpoint wait for the round boundary (``boundary``)."""
        members = len(self.rounds.last.members)
        prev_hash = self.status.params_hash
        if not overlapped:
            await self.evaluate_if_due()
        self.metrics.rounds.inc()
        self.metrics.round.set(self.worker.round)
        self.status.last_round_members = members
        await self.publish_state()
        if self._wire_average is not None:
            codec, pieces, payloads = self._wire_average
            self._wire_average = None
            self.server.averages.add(RoundAverage(self.worker.round, prev_hash, self.status.params_hash, codec,
                                                  pieces, payloads))
        self.rounds.commits.hold(self.worker.round, self.status.params_hash)
        self.rounds.certify(prev_hash, self.status.params_hash)
        # Training for the next round already (overlapped), or about to once evaluated and
        # checkpointed: a gather of the next round waits for us from now on (p2p/gathering.py),
        # not only once the inner steps start.
        self.swarm.announce(state="training")
        self.last_commit = {"round": self.worker.round, "time": time.time(), "loss": self.status.loss,
                            "eval_loss": self.status.eval_loss if self._evaluated == self.worker.round else None,
                            "tokens": weight, "members": members, "allreduce_s": self.rounds.last.allreduce_seconds,
                            "params_hash": self.status.params_hash}
        log.info("committed round=%d hash=%s members=%d group=%s loss=%.4f eval_loss=%.4f allreduce=%.3fs",
                 self.worker.round, self.status.params_hash, members, self.rounds.last.group_id,
                 self.status.loss or float("nan"), self.status.eval_loss or float("nan"),
                 self.rounds.last.allreduce_seconds)
        await self.on_commit(checkpoint=not overlapped)

    async def before_outer_step(self) -> None:
        await self.checking.run()  # node/checking.py

    async def boundary(self) -> None:
        await self.evaluate_if_due()
        await self.on_commit(checkpoint=True)

    async def evaluate_if_due(self) -> None:
        every = self.worker.data_cfg.eval_every
        if every and self.worker.round % every == 0 and self.worker.round != self._evaluated:
            self._evaluated = self.worker.round
            eval_loss = await self.compute(self.worker.eval_loss)
            self.metrics.eval_loss.set(eval_loss)
            self.status.eval_loss = eval_loss

    # ---- joining and staying consistent ---------------------------------------------------

    async def join(self) -> None:
        """Before training: if the swarm holds a newer or different state, download it."""
        if not self.swarm.config.bootstrap:
            return
        deadline = time.monotonic() + max(3 * self.swarm.config.heartbeat_interval, 5.0)
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            peers = await self.swarm.refresh_peers()
            if live_peers(peers, self.swarm.peer_id) - {self.swarm.peer_id}:  # someone holds the swarm's state
                break
            await asyncio.sleep(0.2)
        else:
            if self.swarm.strangers and not self.swarm.peers:
                peer, difference = next(reversed(self.swarm.strangers.items()))
                raise RunMismatch(
                    f"swarm.bootstrap: the swarm of run {self.swarm.run_id!r} trains another run: {difference} "
                    f"(peer {peer}); start with the same --model, --data, --seed and settings, or another --run-id")
            log.warning("no live peer announced itself yet; starting from this node's own state")
            return
        if self.decide(peers, patient=True)[0]:
            await self.resync("join")

    def decide(self, peers, *, patient: bool = True) -> tuple[str, list[tuple[int, str, list[str]]]]:
        """Whether to leave our state, and for which (``quorum.follow``: never one peer's word).
        Quarantined peers vouch for nothing, nor do peers still announcing a state that showed
        us no certificate chain (``Conduct.not_vouching``)."""
        mine = (self.worker.round, self.status.params_hash)
        excluded = self.rounds.conduct.not_vouching(peers, time.monotonic())
        return follow(peers, self.swarm.peer_id, mine, excluded=excluded, patient=patient)

    async def check_consistency(self) -> None:
        """After a commit: if a majority of the other peers holds other parameters of our round,
        or is ahead of us, fetch their state."""
        why, _ = self.decide(await self.swarm.refresh_peers(), patient=False)
        if why:
            await self.resync(why)

    async def resync(self, reason: str) -> None:
        """Replace our global state with the swarm's; local progress of this round is dropped.

        Candidates come best first; each must show a certificate chain from a state we trust
        before a byte of it is downloaded. A donor that sends a certificate no honest peer
        holds gets a strike (p2p/quarantine.py); a chain that only lacks links does not: honest
        peers lack their newest certificate for a moment (``StateDownload.fetch_chain``).

        The swarm may commit again while we download (its inner steps as short as our download):
        then we follow at once, up to ``CATCH_UPS`` times, instead of training for a round it has
        finished; else we would be one round behind at every gather and left out for good."""
        for _ in range(1 + CATCH_UPS):
            if not await self._resync_once(reason) or self.stop_requested.is_set():
                return
            if self.decide(await self.swarm.refresh_peers(), patient=False)[0] != "behind":
                return
            reason = "behind"

    async def _resync_once(self, reason: str) -> bool:
        """One re-sync: True once a state is adopted."""
        commits = self.rounds.commits
        for attempt in range(3):
            why, candidates = self.decide(await self.swarm.refresh_peers())
            if not why or not candidates:
                log.warning("re-sync (%s): no majority of the other peers is ahead or elsewhere", reason)
                return False
            if self.overlapped and await self.round_in_flight(candidates[0][0]):
                continue
            self.set_state("joining")
            download = StateDownload(self.swarm, self.metrics, self.server.name)
            # Left out of a few rounds (stopped, slow, cut off): their averages are enough.
            if why == "behind" and await catch_up(self, download, *candidates[0]):
                self.metrics.resyncs.labels(reason=reason).inc()
                self.round_step = 0
                self.set_state("training")
                log.info("resynced round=%d hash=%s reason=%s from the rounds' averages", self.worker.round,
                         self.status.params_hash, reason)
                await self.on_commit()
                return True
            for round, params_hash, donors in candidates:
                try:
                    chain = await download.fetch_chain(round, params_hash, donors, commits)
                except NoChain as e:
                    log.warning("not following round %d (%s): %s", round, params_hash[:12], e)
                    self.metrics.state_downloads.labels(result="uncertified").inc()
                    for donor in e.liars:
                        self.rounds.conduct.offence(donor, "uncertified_state")
                    for donor in donors:  # their word to follow it counts for nothing while they hold it
                        self.rounds.conduct.unverified(donor, params_hash)
                    continue
                snap = None
                try:
                    download.hold = self.rounds.faults.hold_download
                    mapped = getattr(self.worker, "mapped", None)  # outer.state_dir: on disk, not in RAM
                    download.scratch = mapped.scratch if mapped is not None else None
                    snap = await download.run(round, params_hash, donors,
                                              [list(s) for s in self.worker.state_shapes()])
                    if hasattr(self.worker, "load_shards"):  # a multi-rank host: every rank its shard
                        ok = await self.worker.load_shards(snap, donors, self.compute)
                    else:
                        ok = await self.compute(self._load_verified, snap)
                except (RuntimeError, ValueError) as e:
                    log.warning("state download failed: %s", e)
                    ok = False
                self.metrics.state_downloads.labels(result="ok" if ok else "failed").inc()
                if ok:
                    commits.adopt(chain, round, params_hash)
                    self.server.averages.clear()  # of the lineage we left
                    self.metrics.resyncs.labels(reason=reason).inc()
                    self.metrics.round.set(self.worker.round)
                    self.round_step = 0
                    await self.publish_state()
                    why, ahead = self.decide(await self.swarm.refresh_peers(), patient=False)
                    if why == "behind":  # the swarm committed while we downloaded
                        await catch_up(self, download, *ahead[0], snap=snap)
                    snap = None
                    # Training the next round from here on, and said in the same heartbeat as the
                    # new round: a leader waits for peers training towards its round, not for one
                    # still "joining". Said only later, a peer whose download takes about as long
                    # as the swarm's inner steps is left out of every round and re-syncs forever.
                    self.set_state("training")
                    log.info("resynced round=%d hash=%s reason=%s donors=%d", self.worker.round,
                             self.status.params_hash, reason, len(donors))
                    await self.on_commit()
                    return True
            await asyncio.sleep(RETRY_SECONDS * (attempt + 1))
        return False

    async def round_in_flight(self, round: int) -> bool:
        """Overlapped rounds: if the swarm is averaging round ``round`` right now, wait for
        it to commit (True: look again). Downloading now would put this peer's next
        contribution into a round the others already formed, and it would be left out
        again and again; after the commit it lands in the next one, like everyone's."""
        busy = [p for p, r in self.swarm.peers.items() if r.round == round and r.state in ("ready", "averaging")]
        if not busy:
            return False
        cfg = self.swarm.config
        deadline = time.monotonic() + cfg.gather_timeout + cfg.round_timeout
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            await asyncio.sleep(RETRY_SECONDS)
            peers = await self.swarm.refresh_peers()
            if any(r.round > round for r in peers.values()):
                return True
        return False

    def _load_verified(self, snap: Snapshot) -> bool:
        backup = self.worker.global_state()
        self.worker.load_global_state(snap.unpack())
        if self.worker.params_hash() != snap.params_hash:
            log.warning("downloaded state does not hash to %s; keeping ours", snap.params_hash[:12])
            self.worker.load_global_state(backup)
            return False
        return True

    # ---- what others see ---------------------------------------------------------------------

    @property
    def announced_round(self) -> int:
        """The round this node tells the swarm it holds (a test-only hostile node lies, p2p/hostile.py)."""
        return self.worker.round + (1000 if self.rounds.hostile.fakes_state else 0)

    def set_state(self, state: str) -> None:
        self.status.state = state
        self.swarm.announce(state=state, round=self.announced_round)

    async def publish_state(self) -> None:
        """After the global state changed: new hash, new snapshot for joiners, new heartbeat."""
        w = self.worker
        params_hash = await asyncio.to_thread(w.params_hash)

        def snapshot() -> Snapshot:  # a copy of the whole state: never on the event loop
            from trainer.diloco import params_digest

            shards = w.shard_hashes() if hasattr(w, "shard_hashes") else ()  # a multi-rank host's
            chunk = self.swarm.config.state_chunk_bytes
            mapped = getattr(w, "mapped", None)  # outer.state_dir: the copy on disk, not in RAM
            scratch = mapped.scratch if mapped is not None else None

            def build(round, params, momentum) -> Snapshot:
                # Built whenever a joiner first asks, so its hash is of what it holds, read under
                # the worker's lock with it (a commit may have come since this state was published).
                own = params_digest(params)
                if not shards:
                    return Snapshot.build(round, own, params, momentum, chunk, scratch=scratch)
                from node.ranks import combined_hash

                now = (own, *shards[1:])
                return Snapshot.build(round, combined_hash(list(now)), params, momentum, chunk, now, scratch=scratch)

            return w.with_global_state(build)

        # Built when a joiner first asks for it (p2p/transfer.py); the last one goes now.
        self.server.publish(snapshot)
        self.status.round, self.status.params_hash, self.status.inner_step = w.round, params_hash, w.inner_step
        self.swarm.announce(round=self.announced_round, hash=params_hash, step=w.inner_step, loss=self.status.loss,
                            rtok=self.round_step * self.tokens_per_step)
        if self.rounds.hostile.fakes_state:  # test-only: claim a far newer round with a state of our own
            await asyncio.to_thread(self._serve_fake_state)

    def _serve_fake_state(self) -> None:
        import torch

        from trainer.diloco import params_digest

        zeros = [torch.zeros(s) for s in self.worker.state_shapes()]
        params = zeros
        if self.rounds.hostile.fake_states:  # another state each time: a refused claim gets a new one
            self._fakes += 1
            params = [torch.full(s, self._fakes * 1e-3) for s in self.worker.state_shapes()]
        fake_hash = params_digest(params)
        self.server.serve(Snapshot.build(self.announced_round, fake_hash, params, zeros,
                                         self.swarm.config.state_chunk_bytes))
        self.swarm.announce(round=self.announced_round, hash=fake_hash)

    def trained(self, stats, phase_round: int) -> None:
        if stats.steps:
            # The benchmarks derive compute utilization from these lines (end time, seconds).
            log.info("trained round=%d steps=%d seconds=%.3f loss=%.4f", phase_round, stats.steps,
                     stats.seconds, stats.mean_loss)
            self.metrics.inner_steps.inc(stats.steps)
            self.metrics.tokens.inc(stats.tokens)
            self.metrics.loss.set(stats.mean_loss)
            self.metrics.inner_step_seconds.observe(stats.seconds / stats.steps)
            self.metrics.train_seconds.inc(stats.seconds)
            self.status.loss = stats.mean_loss
        self.status.inner_step = self.worker.inner_step
        self.swarm.announce(step=self.worker.inner_step, loss=self.status.loss)
