"""Ranks 1..N-1 of a multi-rank host: a shard of the model, trained and reduced as rank 0 says.

A follower has no identity, swarm, control socket or metrics endpoint of its own: the host is
one peer, and rank 0 (node/ranks.py) is its voice. It connects to rank 0's socket, builds its
worker (FSDP2 shard) once rank 0 says which peer it is, then serves its shard's all-reduce
requests through the host's ``p2pd`` (``P2P.replicate``: the same peer id, its own request
names, p2p/shard.py) and answers rank 0's requests one phase at a time.

It ignores SIGINT and SIGTERM: a stop is rank 0's to decide (its final checkpoint needs
every rank), and the launcher's signal reaches rank 0 too. It exits when rank 0 says stop,
and when rank 0's link closes (rank 0 died: nothing here can go on).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import torch

from node.config import Config, FaultInjection
from node.ranks import MAX_MESSAGE_BYTES, SOCKET_ENV
from p2p.wire import WireError, close_writer, read_frame, write_frame

log = logging.getLogger("gonka.node")

CONNECT_SECONDS = 120.0  # rank 0 imports, starts p2pd and its swarm first
END_WAIT_SECONDS = 30.0  # for a cancelled attempt's task to end (its network waits are cancelled at once)


def run_follower(config: Config, injection: FaultInjection | None = None) -> int:
    import uvloop

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        return uvloop.run(RankFollower(config, injection).run())
    except Exception as e:
        log.error("rank %s: %s", os.environ.get("RANK"), e)
        return 1


class RankFollower:
    def __init__(self, config: Config, injection: FaultInjection | None = None) -> None:
        self.config = config
        # Test hooks: a rank dies where rank 0 would (p2p/faults.py); it never lies (p2p/hostile.py).
        self.faults = (injection or FaultInjection()).faults
        self.rank = int(os.environ["RANK"])
        self.worker = None
        self.compute = None
        self.p2p = None
        self.plane = None
        self.delta = None  # this round's pseudo-gradient of our shard
        self.flat = None  # ... flattened, error feedback added: what our groups reduce
        self.averaged = None  # the committed round's average of our shard, until the outer step
        self.tasks: dict[bytes, asyncio.Task] = {}  # group id -> its reduce
        self.groups: dict[bytes, object] = {}
        self._feedback_state = None  # the residual a checkpoint held, loaded once the plane exists
        self.counts = RankCounts()
        self.server = None  # our shard of the state, served to joiners
        self.fetched = None  # a downloaded shard, until rank 0 says load it (every rank has one) or drop it

    async def run(self) -> int:
        from node.compute import ComputeThread

        cfg = self.config
        reader, writer = await self._connect()
        await write_frame(writer, {"rank": self.rank})
        self.compute = ComputeThread(cfg.node.threads or torch.get_num_threads())
        torch.set_num_threads(1)
        await self.compute.start()
        code = 0
        try:
            while True:
                header, _ = await read_frame(reader, None, max_header=MAX_MESSAGE_BYTES, max_payload=0)
                op = header.get("op")
                if op == "stop":
                    break
                asyncio.ensure_future(self._answer(writer, header))
        except (WireError, ConnectionError, OSError, asyncio.IncompleteReadError, EOFError):
            log.error("rank %d: rank 0 is gone; stopping", self.rank)
            code = 1
        finally:
            for task in self.tasks.values():
                task.cancel()
            if self.p2p is not None:
                await self.p2p.shutdown()
            await asyncio.to_thread(self.compute.close)
            await close_writer(writer)
        return code

    async def _connect(self):
        path = os.environ[SOCKET_ENV]
        deadline = time.monotonic() + CONNECT_SECONDS
        while True:
            try:
                return await asyncio.open_unix_connection(path)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank 0's socket {path} did not open within {CONNECT_SECONDS:.0f}s")
                await asyncio.sleep(0.1)

    async def _answer(self, writer, header: dict) -> None:
        op, rid = header.get("op"), header.get("id")
        try:
            handler = getattr(self, f"_op_{op}", None)
            if handler is None:
                raise RuntimeError(f"unknown request {op!r}")
            answer = await handler(header) or {}
        except Exception as e:
            log.exception("rank %d: %s failed", self.rank, op)
            answer = {"error": f"{e.__class__.__name__}: {e}"[:500]}
        try:
            await write_frame(writer, {"id": rid, **answer, "counts": self.counts.take()})
        except (ConnectionError, OSError):
            pass

    # ---- start-up ------------------------------------------------------------------

    async def _op_setup(self, h: dict) -> dict:
        """Build this rank's worker for the host ``peer``; answer with its shard's hashes."""
        from trainer.data import open_source
        from trainer.diloco import DiLoCoWorker
        from trainer.parallel import init_ranks

        cfg = self.config
        corpus = await asyncio.to_thread(open_source, cfg.data.paths, verify=False)
        ranks = init_ranks(cfg.host.parallel, h["device"])
        self.worker = await self.compute(
            lambda: DiLoCoWorker(model=cfg.model, data=cfg.data, inner=cfg.inner, outer=cfg.outer, corpus=corpus,
                                 shard_key=h["peer"], seed=cfg.node.seed, ranks=ranks))
        init_hash = self.worker.init_hash
        if cfg.node.checkpoint_dir:  # rank 0 checked the checkpoint is complete; our part of it
            from trainer.checkpoint import load_host_part

            part = await asyncio.to_thread(load_host_part, cfg.node.checkpoint_dir, self.rank, ranks.world)
            if part is not None:
                await self.compute(self.worker.load_state_dict, part["worker"])
                self._feedback_state = part.get("feedback")
        return {"init_hash": init_hash, "hash": await self.compute(self.worker.params_hash)}

    async def _op_serve(self, h: dict) -> dict:
        """Serve our shard's requests under the run's scope through the host's p2pd."""
        from hivemind.p2p import P2P
        from p2p._multiaddr import Multiaddr
        from p2p.codecs import get_codec
        from p2p.deadline import DeadlinePolicy
        from p2p.hostile import HONEST
        from p2p.limits import StreamLimits
        from p2p.shard import DATA_REQUESTS, Dialer, ShardPlane, guarded, shard_names
        from p2p.stateserver import ShardStateServer

        cfg = self.config.swarm
        self.p2p = await P2P.replicate(Multiaddr(h["maddr"]))
        metrics = self.counts
        dial = Dialer(self.p2p, shard_names(h["scope"], DATA_REQUESTS, self.rank), cfg.request_timeout, metrics)
        codec = get_codec(cfg.codec)
        deadlines = DeadlinePolicy(ceiling=cfg.round_timeout, floor=min(5.0, cfg.round_timeout))

        def reject(reason: str, detail: str = "") -> None:
            metrics.rejected[reason] = metrics.rejected.get(reason, 0) + 1
            log.info("rank %d: rejected %s %s", self.rank, reason, detail[:120])

        self.plane = ShardPlane(me=h["peer"], codec=codec, use_feedback=cfg.error_feedback and codec.name != "fp32",
                                aggregator=cfg.aggregator, weight_cap=float(h["cap"]), hostile=HONEST,
                                feedback_decay=cfg.error_feedback_decay,
                                faults=self.faults, dial=dial, metrics=metrics, reject=reject,
                                offence=lambda peer, reason: None,
                                deadlines=deadlines, request_timeout=cfg.request_timeout)
        if self.worker.mapped is not None:  # outer.state_dir: the residual on disk too
            self.plane.scratch = self.worker.mapped.scratch
        streams = StreamLimits(cfg.max_streams_per_peer)

        async def anyone(_peer: str) -> bool:  # membership is checked per group (ShardPlane.group_for)
            return True

        await self.plane.start(self.p2p, lambda handler: guarded(
            handler, streams=streams, admits=anyone, reject=reject, on_flood=lambda peer: None,
            limit=deadlines.ceiling + 3 * cfg.request_timeout, request_timeout=cfg.request_timeout))
        # Our shard of the state, for joiners rank 0 lets in (p2p/stateserver.py).
        self.state_name = f"gonka.{h['scope']}.state.s{self.rank}"
        self.reject = reject
        self.server = ShardStateServer(self.p2p, self.state_name, streams, reject, metrics, cfg.request_timeout,
                                       faults=self.faults)
        await self.server.start(lambda handler: guarded(
            handler, streams=streams, admits=anyone, reject=reject, on_flood=lambda peer: None,
            limit=3 * cfg.request_timeout, request_timeout=cfg.request_timeout))
        kernels = getattr(codec, "kernels", None)
        if kernels is not None:
            await asyncio.to_thread(kernels)
        if self._feedback_state is not None:
            numel = sum(t.numel() for t in self.worker.global_params)
            feedback = self.plane.ensure_feedback(numel)
            if feedback is not None:
                feedback.load_state_dict(self._feedback_state)
        return {}

    async def _op_checkpoint(self, h: dict) -> dict:
        """Write our part of the host's checkpoint ``seq`` (rank 0 makes it the latest)."""
        from trainer.checkpoint import save_host_part

        feedback = self.plane.feedback if self.plane is not None else None
        state = {"worker": await asyncio.to_thread(self.worker.state_dict),
                 "feedback": feedback.state_dict() if feedback is not None else None}
        await asyncio.to_thread(save_host_part, str(h["dir"]), int(h["seq"]), self.rank, state)
        return {}

    # ---- training ------------------------------------------------------------------------

    async def _op_assign_data(self, h: dict) -> dict:
        self.worker.assign_data(str(h["key"]))
        return {}

    async def _op_inner_steps(self, h: dict) -> dict:
        def train():
            if "round" in h:  # the round rank 0 trains for, and its step in it (node/ranks.py)
                self.worker.train_for(int(h["round"]), int(h["step"]))
            return self.worker.inner_steps(int(h["n"]), None)

        stats = await self.compute(train)
        loss_sum = stats.mean_loss * stats.steps if stats.steps else 0.0
        return {"steps": stats.steps, "tokens": stats.tokens, "loss_sum": loss_sum, "seconds": stats.seconds}

    async def _op_eval_loss(self, h: dict) -> dict:
        return {"loss": await self.compute(self.worker.eval_loss)}

    async def _op_pseudo_gradient(self, h: dict) -> dict:
        from p2p.compression import base_vector

        # Into error feedback's vector where it is free (no vector of Δ alone), as rank 0 does.
        self.delta = await self.compute(self.worker.pseudo_gradient, self.plane.delta_target())
        numel = sum(t.numel() for t in self.delta)
        feedback = self.plane.ensure_feedback(numel)
        # The pseudo-gradient is one vector already: our groups reduce it as it is, the residual
        # added in place (once a round: every attempt of it reduces this vector).
        self.flat = base_vector(self.delta)
        if feedback is not None:
            await self.compute(self.plane.fold, self.flat)  # the residual's vector from now on
        return {}

    async def _op_reduce(self, h: dict) -> dict:
        """Our shard in the group rank 0 formed: its digest, or why it failed."""
        from p2p.failure import RoundFailed

        gid = h["g"]
        group = self.plane.new_group(gid, int(h["r"]), list(h["members"]), self.flat, float(h["w"]),
                                     lanes=int(h["lanes"]), owners=h.get("owners"), factors=h.get("factors"))
        self.plane.install(group)
        self.groups[gid] = group
        deadline = asyncio.get_running_loop().time() + float(h["t"])
        task = self.tasks[gid] = asyncio.ensure_future(self.plane.reduce(group, deadline))
        try:
            digest = await task
        except RoundFailed as e:
            return {"ok": False, "reason": e.reason, "detail": str(e)[:200]}
        except asyncio.CancelledError:
            return {"ok": False, "reason": "aborted"}
        finally:
            self.tasks.pop(gid, None)
        return {"ok": True, "digest": digest}

    async def _op_end(self, h: dict) -> dict:
        gid = h["g"]
        group = self.groups.pop(gid, None)
        task = self.tasks.pop(gid, None)
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=END_WAIT_SECONDS)  # its tensor work queued before ours
        if group is None:
            return {}
        self.plane.leave(group)
        if h.get("commit"):
            if group.residual_to_write:  # what the round did not deliver of what we sent, for the next one
                from p2p.exchange import off_loop

                await off_loop(group.write_residual)
            self.plane.committed(group)
            self.averaged = group.committed_average(self.delta)  # decoded by the outer step
        return {}

    async def _op_apply_outer(self, h: dict) -> dict:
        if self.averaged is None:
            raise RuntimeError("no committed average to apply")
        averaged, self.averaged = self.averaged, None
        self.server.snapshot = None  # of a state we no longer hold; rank 0 asks for the next when a joiner does
        reset = bool(h.get("reset", True))
        if reset:
            await self.compute(self.worker.apply_outer, averaged)
            return {"hash": await self.compute(self.worker.params_hash)}
        # Overlapped: the trainer's thread is busy with the next round's steps (which land it,
        # every rank at one step): the outer step runs beside them, as on rank 0.
        await asyncio.to_thread(self.worker.apply_outer, averaged, reset_local=False)
        return {"hash": await asyncio.to_thread(self.worker.params_hash)}

    async def _op_start_overlapped(self, h: dict) -> dict:
        # Our Δ alone is in no vector once error feedback exists (it went into the residual's,
        # and a fold added the residual): the preview computes it again, tensor by tensor.
        own = self.delta if self.plane.feedback is None else None
        await self.compute(self.worker.start_overlapped, own)
        return {}

    async def _op_land(self, h: dict) -> dict:
        await asyncio.to_thread(self.worker.land)
        return {}

    async def _op_reset_local(self, h: dict) -> dict:
        await self.compute(self.worker.reset_local)
        return {}

    # ---- state for joiners, and joining ---------------------------------------------------

    async def _op_publish(self, h: dict) -> dict:
        """Our shard's snapshot of the state for joiners (built off the event loop), when rank 0
        builds its own: when a joiner first asks for it (p2p/stateserver.py)."""
        from p2p.snapshot import Snapshot
        from trainer.diloco import params_digest

        w, chunk = self.worker, self.config.swarm.state_chunk_bytes

        def build():  # its hash read with what it holds, under the worker's lock (as rank 0's)
            return w.with_global_state(lambda round, params, momentum: Snapshot.build(
                round, params_digest(params), params, momentum, chunk,
                scratch=w.mapped.scratch if w.mapped is not None else None))

        self.server.snapshot = None  # as rank 0 (node/loop.py publish_state): never two copies
        self.server.snapshot = await asyncio.to_thread(build)
        return {"hash": self.server.snapshot.params_hash}

    async def _op_allow(self, h: dict) -> dict:
        self.server.allow(str(h["peer"]))
        return {}

    async def _op_fetch(self, h: dict) -> dict:
        """Download our shard of (round, the host's hash) from the donors' rank of our number and
        check it is the shard rank 0 verified the hash of; nothing is loaded yet."""
        from p2p.transfer import StateDownload
        from trainer.diloco import params_digest

        want = str(h["hashes"][self.rank])
        download = StateDownload.through(self.p2p, self.reject, self.config.swarm.request_timeout, self.counts,
                                         self.state_name)
        snap = await download.run(int(h["round"]), want, list(h["donors"]),
                                  [list(s) for s in self.worker.state_shapes()])
        state = await asyncio.to_thread(snap.unpack)
        if await asyncio.to_thread(params_digest, state["params"]) != want:
            raise RuntimeError("the downloaded shard does not hash to the one its donors' rank 0 listed")
        self.fetched = state
        return {}

    async def _op_load_fetched(self, h: dict) -> dict:
        state, self.fetched = self.fetched, None
        if state is None:
            raise RuntimeError("no downloaded shard to load")
        self.server.snapshot = None
        await self.compute(self.worker.load_global_state, state)
        return {"hash": await self.compute(self.worker.params_hash)}

    async def _op_drop_fetched(self, h: dict) -> dict:
        self.fetched = None
        return {}


class _Counter:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def observe(self, value: float) -> None:  # a duration rank 0 times itself
        pass


class RankCounts:
    """What this rank's shard plane counts (bytes, rejected input by reason), handed to rank
    0's metrics with each answer: a rank has no metrics endpoint of its own."""

    def __init__(self) -> None:
        self.sent_bytes, self.received_bytes, self.state_served = _Counter(), _Counter(), _Counter()
        self.state_download_seconds = _Counter()
        self.rejected: dict[str, int] = {}

    def take(self) -> dict:
        counts = {"sent": self.sent_bytes.value, "received": self.received_bytes.value,
                  "served": self.state_served.value, "rejected": self.rejected}
        self.sent_bytes.value = self.received_bytes.value = self.state_served.value = 0.0
        self.rejected = {}
        return counts
