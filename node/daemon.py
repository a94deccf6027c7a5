"""The daemon behind `gonka-node start`: one owner of the node's lifecycle.

Start order: data and model (fail fast on bad input), identity, metrics,
control socket, swarm (p2pd + DHT), round protocol, state server, training
loop. Stop order is the reverse, after a final checkpoint; cleanup collects
errors instead of stopping at the first. SIGINT/SIGTERM abandon the current
inner step or round and stop cleanly with exit code 0.

``Node`` owns the order; each piece it starts is its own class: the
checkpoints (node/checkpoints.py), the control socket's answers
(node/control_api.py), the round history (node/history.py), the training
loop (node/loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time

import torch

from node.checkpoints import NodeCheckpoints
from node.config import Config, FaultInjection, setting_errors
from node.control_api import ControlAPI
from node.errors import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, UsageError, report, version
from node.history import RoundRecorder
from node.loop import RunMismatch
from node.status import Status, write_status_file
from p2p.tcpsettings import TcpSettings

log = logging.getLogger("gonka.node")

RANKS_CONNECT_SECONDS = 120.0  # the other ranks of a multi-rank host import torch and connect


def run_node(config: Config, injection: FaultInjection | None = None) -> int:
    """Run a node until it stops; returns the process exit code.

    Bad input found at start-up is reported here as one line (exit code 2); any other
    exception (a ValueError too) propagates: a fault of the program, not the user's."""
    import uvloop

    try:
        return uvloop.run(Node(config, injection).run())
    except UsageError as e:
        report(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


def member_weight_cap(config: Config) -> float:
    """A member's weight counts at most twice the round-token budget, or (0: no budget) twice the
    members' median weight (p2p/aggregate.py capped_weights)."""
    return 2.0 * config.inner.round_tokens


def fingerprint_terms(config: Config) -> tuple[str, str]:
    """(codec, round rules): what a node's run fingerprint covers besides what its worker knows
    (``DiLoCoWorker.fingerprint``); with them the simulator derives a node's run key."""
    from p2p.codecs import get_codec

    cap = member_weight_cap(config)
    # The codec's canonical name: sparse-c4096 and sparse are one format.
    return (get_codec(config.swarm.codec).name,
            f"agg={config.swarm.aggregator},cap={int(cap) if cap else 'relative'}"
            + (f",checked={config.swarm.checked_members}" if config.swarm.checked_members != 2 else ""))


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"node.device: {name} requested but no CUDA device is available")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UsageError(f"node.device: {name} requested but this host has {torch.cuda.device_count()} CUDA devices")
    return name


class Node:
    """One node's lifecycle: starts its components in order, runs the training loop, stops them
    in reverse order (see the module docstring)."""

    def __init__(self, config: Config, injection: FaultInjection | None = None) -> None:
        self.config = config
        self.injection = injection or FaultInjection()  # test hooks (p2p/faults.py, p2p/hostile.py)
        self.status = Status(run_id=config.node.run_id, version=version())
        self.checkpoints = NodeCheckpoints(config.node.checkpoint_dir, config.node.run_id,
                                           config.host.nproc_per_node)
        self.metrics = None
        self.history = None  # the round history (node/history.py), once the metrics exist
        self.control = None
        self.swarm = None
        self.loop_ = None
        self.worker = None
        self._stop_early = False  # a signal arrived before the training loop existed
        self.corpus = None
        self.compute = None
        self.ranks = None  # rank 0 of a multi-rank host: the link to the others (node/ranks.py)
        # A problem found while training (e.g. a corrupt shard): the node stops with exit code 1.
        self._failure: str | None = None

    async def run(self) -> int:
        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            # The components say which setting is wrong with ValueError("section.key: ..."):
            # the user's input, exit code 2. Any other ValueError is a fault and propagates.
            with setting_errors():
                await self.start()
        except (UsageError, ValueError):
            await self.close()
            self._remove_signal_handlers()
            raise
        except Exception as e:
            log.error("start-up failed: %s", e)
            await self.close()
            self._remove_signal_handlers()
            return EXIT_RUNTIME
        code = EXIT_OK
        if self._stop_early:
            self.loop_.request_stop()
        try:
            self._tell(f"gonka-node {self.status.version} peer {self.swarm.peer_id} run {cfg.node.run_id}")
            for addr in self.swarm.maddrs:
                self._tell(f"listening on {addr}")
            if self.metrics.bound_port is not None:
                host = cfg.node.metrics_addr.rsplit(":", 1)[0]
                self._tell(f"metrics on http://{host}:{self.metrics.bound_port}/metrics")
            tcp = TcpSettings.read()
            for advice in tcp.warnings() if tcp is not None else ():
                log.warning("%s", advice)
            checks = self._start_background_checks()
            try:
                await self.loop_.run()
            finally:
                for task in checks:
                    task.cancel()
                await asyncio.gather(*checks, return_exceptions=True)
            if self._failure is not None:
                report(self._failure)
                code = EXIT_RUNTIME
        except RunMismatch as e:
            report(str(e))
            code = EXIT_USAGE
        except Exception:
            log.exception("training loop failed")
            code = EXIT_RUNTIME
        finally:
            await self.close()
            self._remove_signal_handlers()
        return code

    def _start_background_checks(self) -> list[asyncio.Task]:
        """Whether peers can dial this node, asked now and then; with data.verify = background, hash
        the token shards while training."""
        tasks = [asyncio.create_task(self._check_reachability(), name="reachability")]
        if self.config.data.verify != "background" or not hasattr(self.corpus, "verify"):
            return tasks
        stop = threading.Event()

        async def verify() -> None:
            from trainer.tokens import Stopped

            started = time.monotonic()
            try:
                await asyncio.to_thread(self.corpus.verify, stop.is_set)
            except Stopped:
                return
            except asyncio.CancelledError:
                stop.set()  # the hashing thread stops at its next chunk
                raise
            except ValueError as e:
                self._failure = str(e)
                log.error("%s: stopping", e)
                self.loop_.request_stop()
                return
            log.info("data verified: every shard matches its manifest sha256 (%.1fs)", time.monotonic() - started)

        return tasks + [asyncio.create_task(verify(), name="verify-data")]

    async def _check_reachability(self) -> None:
        """Whether peers can dial us (p2p/reachability.py), in status and metrics as it changes."""

        def changed(found: bool) -> None:
            self.status.reachable = found
            self.metrics.reachable.set(1 if found else 0)
            self.write_status()

        await self.loop_.rounds.reachability.run(self.config.swarm.heartbeat_interval, changed)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        log.info("%s received: stopping after a final checkpoint", signal.Signals(sig).name)
        self._stop_early = True
        if self.loop_ is not None:
            self.loop_.request_stop()

    # ---- start -------------------------------------------------------------------

    async def start(self) -> None:
        from node.allocator import tune_malloc
        from node.compute import ComputeThread
        from node.control import ControlServer
        from node.loop import TrainingLoop
        from node.metrics import NodeMetrics
        from p2p.commits import CommitLog
        from p2p.identity import load_or_create_identity
        from p2p.rounds import RoundProtocol
        from p2p.stateserver import StateServer
        from p2p.swarm import Swarm
        cfg = self.config
        tune_malloc()
        # The trainer's thread gets the intra-op threads; every other thread one (node/compute.py).
        self.compute = ComputeThread(cfg.node.threads or torch.get_num_threads())
        torch.set_num_threads(1)
        device = resolve_device(cfg.node.device)
        from trainer.model import check_source

        await asyncio.to_thread(check_source, cfg.model)
        from trainer.data import open_source

        self.corpus = corpus = await asyncio.to_thread(open_source, cfg.data.paths, verify=cfg.data.verify == "start")
        checkpoint = await asyncio.to_thread(self.checkpoints.load) if self.checkpoints.enabled else None
        identity = cfg.node.identity or None
        if identity:
            load_or_create_identity(identity)

        self.metrics = NodeMetrics()
        self.metrics.min_peers.set(cfg.swarm.min_peers)
        self.history = RoundRecorder(cfg.node.checkpoint_dir, self.metrics)
        if cfg.node.metrics_addr != "off":
            try:
                self.metrics.start(cfg.node.metrics_addr)
            except (OSError, RuntimeError) as e:
                raise UsageError(str(e) if str(e).startswith("node.") else f"node.metrics_addr: {e}")
        control_path = cfg.node.control_path()
        api = ControlAPI(self.status, self.metrics, cfg.node.run_id, self.write_status)
        if control_path:
            self.control = ControlServer(control_path, api.handlers(), private_dir=not cfg.node.control)
            try:
                await self.control.start()
            except RuntimeError as e:
                self.control = None
                raise UsageError(str(e))

        self.swarm = await Swarm.start(
            cfg.swarm, cfg.node.run_id, identity_path=identity,
            on_reject=lambda reason: self.metrics.rejected_messages.labels(reason=reason).inc(),
            announce=False,  # into the peer table only once the run's fingerprint is known
        )
        api.attach(self.swarm)
        self.status.peer_id = self.swarm.peer_id
        self.status.multiaddrs = list(self.swarm.maddrs)
        self.metrics.set_info(self.swarm.peer_id, cfg.node.run_id, self.status.version)

        await self.compute.start()
        weight_cap = member_weight_cap(cfg)
        self.worker = await self._start_worker(corpus, device, checkpoint)
        # Hashes the byte corpus (up to 64 MiB) the first time: off the event loop.
        fingerprint = await self.compute(self.worker.fingerprint, *fingerprint_terms(cfg))
        genesis = self.worker.init_hash  # θ as built, before any checkpoint was loaded
        if checkpoint is not None:
            self.checkpoints.check_fingerprint(checkpoint, fingerprint)
        await self.swarm.set_fingerprint(fingerprint)
        log.info("run fingerprint %s (%s)", fingerprint.digest[:16],
                 ", ".join(f"{k}={v}" for k, v in fingerprint.parts.items()))
        # Which batches a member trains on in a round follows from the run, its peer id and the
        # round (trainer/data.py): every peer can reconstruct them. Every rank of a host too.
        await self.compute(self.worker.assign_data, fingerprint.digest)
        if self.injection.hostile.shirk:  # test-only: train on data of another key than our own
            self.worker.sampler.shard_key += "/elsewhere"
        commits = CommitLog(self.swarm.scope, genesis)
        rounds = RoundProtocol(self.swarm, self.metrics, commits, weight_cap=weight_cap,
                               faults=self.injection.faults, hostile=self.injection.hostile)
        if getattr(self.worker, "mapped", None) is not None:  # outer.state_dir: the residual on disk too
            rounds.plane.scratch = self.worker.mapped.scratch
        if self.ranks is not None:  # the other ranks serve their shards under the run's scope
            from node.ranks import HostShards

            await self.ranks.request("serve", maddr=str(self.swarm.p2p.daemon_listen_maddr), scope=self.swarm.scope,
                                     peer=self.swarm.peer_id, cap=weight_cap)
            rounds.shards = HostShards(self.ranks)
        # A multi-rank host's average is of rank 0's shard only: it keeps none (joiners re-download).
        server = StateServer(self.swarm, self.metrics, commits, faults=self.injection.faults,
                             catchup_rounds=cfg.swarm.catchup_rounds if self.ranks is None else 0)
        if self.ranks is not None:  # a peer rank 0 serves the meta to may fetch every rank's shard
            ranks = self.ranks
            server.on_meta = lambda peer: ranks.request("allow", peer=peer)
        self.loop_ = TrainingLoop(worker=self.worker, swarm=self.swarm, rounds=rounds, server=server,
                                  compute=self.compute,
                                  metrics=self.metrics, status=self.status, inner_steps=cfg.inner.steps,
                                  max_rounds=cfg.node.max_rounds, on_commit=self.after_commit)
        if checkpoint is not None:  # a multi-rank host's ranks loaded theirs together (_start_worker)
            self.checkpoints.restore(checkpoint, self.loop_, worker_loaded=self.ranks is not None)
        self.metrics.round.set(self.worker.round)
        await rounds.start()
        await server.start()

    async def _start_worker(self, corpus, device: str, checkpoint: dict | None = None):
        """This host's worker: the model in this process, or (a multi-rank host) rank 0's shard of
        it with the other ranks' behind it (node/ranks.py), each rank's part of ``checkpoint``
        loaded as the others load theirs (with DDP a load ends in a collective of every rank)."""
        from trainer.diloco import DiLoCoWorker

        cfg = self.config
        if cfg.host.nproc_per_node == 1:
            return await self.compute(
                lambda: DiLoCoWorker(model=cfg.model, data=cfg.data, inner=cfg.inner, outer=cfg.outer, corpus=corpus,
                                     shard_key=self.swarm.peer_id, seed=cfg.node.seed, device=device))
        from node.ranks import SOCKET_ENV, HostRanks, HostWorker
        from trainer.parallel import init_ranks

        self.ranks = HostRanks(os.environ[SOCKET_ENV], cfg.host.nproc_per_node, on_lost=self._rank_lost,
                               on_counts=self.metrics.add_rank_counts)
        await self.ranks.start(timeout=RANKS_CONNECT_SECONDS)
        # Every rank builds its shard at once (the process group forms as they join it).
        setup = asyncio.ensure_future(self.ranks.request("setup", peer=self.swarm.peer_id, device=device))

        def build():
            ranks = init_ranks(cfg.host.parallel, device)
            worker = DiLoCoWorker(model=cfg.model, data=cfg.data, inner=cfg.inner, outer=cfg.outer, corpus=corpus,
                                  shard_key=self.swarm.peer_id, seed=cfg.node.seed, ranks=ranks)
            if checkpoint is not None:  # (init_hash stays θ as built: the run's fingerprint)
                NodeCheckpoints.load_worker(worker, checkpoint)
            return worker

        local = await self.compute(build)
        replies = await setup
        return HostWorker(local, self.ranks, [r["hash"] for r in replies], [r["init_hash"] for r in replies])

    def _rank_lost(self, why: str) -> None:
        """Another rank of this host died: the round in flight fails on its own (HostShards);
        the node stops, and the launcher stops the host's other ranks."""
        if self._failure is None:
            self._failure = f"host rank lost: {why}"
        if self.loop_ is not None:
            self.loop_.request_stop()

    def _tell(self, line: str) -> None:
        """A line for the user: on stdout as is, or a log record where every line is JSON."""
        if self.config.node.log_format == "json":
            log.info("%s", line)
        else:
            print(line, flush=True)

    # ---- after each commit and on stop ----------------------------------------------

    async def after_commit(self, checkpoint: bool = True) -> None:
        """The training loop's ``on_commit``: the round's history line and heartbeat, a checkpoint
        unless the loop says it is not the time, and the status file."""
        if self.loop_ is not None:
            self.history.record(self.loop_)
        if checkpoint:
            await self.checkpoint()
        self.write_status()

    async def checkpoint(self, final: bool = False) -> None:
        if self.loop_ is not None:
            await self.checkpoints.save(self.loop_, self.ranks, final=final)

    def write_status(self) -> None:
        if self.swarm is not None:
            if self.status.state != "stopped":  # what the swarm is told: ready or averaging while in a round
                self.status.state = self.swarm.state
            self.status.peers = 1 + len(self.swarm.peers)
            self.metrics.peers.set(self.status.peers)
        if self.config.node.status_file:
            try:
                write_status_file(self.config.node.status_file, self.status)
            except OSError as e:
                log.warning("cannot write status file: %s", e)

    # ---- stop ------------------------------------------------------------------------

    async def close(self) -> None:
        """Final checkpoint, leave the swarm, close everything; collect errors."""
        errors = []
        steps = []
        if self.loop_ is not None:
            steps.append(("checkpoint", lambda: self.checkpoint(final=True)))
        if self.compute is not None:
            compute = self.compute
            steps.append(("compute", lambda: asyncio.to_thread(compute.close)))
        if self.ranks is not None:
            steps.append(("ranks", self.ranks.close))
        if self.swarm is not None:
            steps.append(("swarm", self.swarm.close))
        if self.control is not None:
            steps.append(("control", self.control.close))
        for name, step in steps:
            try:
                await step()
            except Exception as e:
                errors.append(f"{name}: {e!r}")
        self.status.state = "stopped"
        if self.loop_ is not None:
            with contextlib.suppress(Exception):
                self.write_status()
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.metrics.close()
        for e in errors:
            log.warning("shutdown: %s", e)
