"""Rank 0 of a multi-rank host: the node, and its link to the host's other ranks.

A host with ``--nproc-per-node N`` is N processes under ``torch.distributed.run``
(node/launch.py). Rank 0 is the node as a single-rank host runs it: identity, swarm,
control socket, metrics, round protocol, training loop. Ranks 1..N-1 (node/follower.py)
each hold their shard of the model and of the outer state, take the same inner steps (FSDP
keeps them in lockstep) and reduce their shard in the groups rank 0 forms. Rank 0 tells them
what to do over a unix socket in a private directory the launcher made, one request at a
time per phase; they answer with what rank 0 needs to know (losses, tokens, shard digests,
parameter hashes).

``HostWorker`` is the worker the training loop sees on rank 0: every call that changes or
reads the whole host's state goes to every rank, and what comes back is combined (the
host's tokens, its mean loss, one ``params_hash`` over every shard). ``HostShards`` is what
the round protocol sees: the other ranks' shards of a group, reduced at once with its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os

from p2p.failure import RoundFailed
from p2p.group import Group
from p2p.wire import WireError, close_writer, read_frame, write_frame
from trainer.diloco import DiLoCoWorker, InnerStats

log = logging.getLogger("gonka.node")

# The environment variable naming the socket rank 0 listens on (set by node/launch.py).
SOCKET_ENV = "GONKA_RANKS_SOCKET"
# Messages between ranks are small: phases and digests, never tensors.
MAX_MESSAGE_BYTES = 1 << 20


class RankLost(RuntimeError):
    """Another rank of this host died or stopped answering: the host cannot go on."""


def combined_hash(shard_hashes: list[str]) -> str:
    """The ``params_hash`` of a multi-rank host: one digest over its shards' in rank order."""
    h = hashlib.blake2b(digest_size=16)
    for x in shard_hashes:
        h.update(x.encode() + b"\0")
    return h.hexdigest()


class _Link:
    """One follower's connection: requests by id, answers matched as they come."""

    def __init__(self, rank: int, reader, writer) -> None:
        self.rank = rank
        self.reader, self.writer = reader, writer
        self.waiting: dict[int, asyncio.Future] = {}
        self.lost: str | None = None
        self.task: asyncio.Task | None = None

    async def listen(self) -> None:
        try:
            while True:
                header, _ = await read_frame(self.reader, None, max_header=MAX_MESSAGE_BYTES, max_payload=0)
                fut = self.waiting.pop(header.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(header)
        except (WireError, ConnectionError, OSError, asyncio.IncompleteReadError, EOFError) as e:
            self._lose(f"rank {self.rank} closed its link ({e.__class__.__name__})")
        except asyncio.CancelledError:
            self._lose("closing")
            raise

    def _lose(self, why: str) -> None:
        self.lost = self.lost or why
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(RankLost(self.lost))
        self.waiting.clear()


class HostRanks:
    """Rank 0's side of the link to ranks 1..N-1."""

    def __init__(self, path: str, world: int, *, on_lost=None, on_counts=None) -> None:
        self.path = path
        self.world = world
        self.links: dict[int, _Link] = {}
        self._ids = itertools.count(1)
        self._all_in = asyncio.Event()
        self._server = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_lost = on_lost  # called once when a rank is lost: the node stops
        self.on_counts = on_counts  # what a rank counted (bytes, rejected input), for rank 0's metrics

    async def start(self, timeout: float) -> None:
        """Listen, and wait until every other rank has said hello."""
        self.loop = asyncio.get_running_loop()
        self._server = await asyncio.start_unix_server(self._accept, self.path)
        try:
            async with asyncio.timeout(timeout):
                await self._all_in.wait()
        except TimeoutError:
            missing = sorted(set(range(1, self.world)) - set(self.links))
            raise RankLost(f"ranks {missing} did not connect within {timeout:.0f}s") from None

    async def _accept(self, reader, writer) -> None:
        try:
            header, _ = await read_frame(reader, 30.0, max_header=MAX_MESSAGE_BYTES, max_payload=0)
        except (WireError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            log.warning("ranks: a bad hello on the host's socket: %s", e)
            await close_writer(writer)
            return
        rank = header.get("rank")
        if not isinstance(rank, int) or not 1 <= rank < self.world or rank in self.links:
            log.warning("ranks: refused a hello from rank %r", rank)
            await close_writer(writer)
            return
        link = self.links[rank] = _Link(rank, reader, writer)
        link.task = asyncio.ensure_future(self._listen(link))
        if len(self.links) == self.world - 1:
            self._all_in.set()

    async def _listen(self, link: _Link) -> None:
        await link.listen()
        if self.on_lost is not None and link.lost != "closing":
            log.error("ranks: %s; this host leaves the swarm", link.lost)
            self.on_lost(link.lost)

    async def request(self, op: str, **fields) -> list[dict]:
        """Send ``op`` to every other rank; their answers in rank order (RankLost if one is gone,
        RuntimeError if one failed at it)."""
        futures = []
        for rank in range(1, self.world):
            link = self.links.get(rank)
            if link is None or link.lost:
                raise RankLost(link.lost if link else f"rank {rank} is not connected")
            rid = next(self._ids)
            fut = self.loop.create_future()
            link.waiting[rid] = fut
            futures.append(fut)
            try:
                await write_frame(link.writer, {"op": op, "id": rid, **fields})
            except (ConnectionError, OSError) as e:
                link._lose(f"rank {rank}: {e!r}")
        replies = await asyncio.gather(*futures)
        for rep in replies:
            counts = rep.pop("counts", None)
            if self.on_counts is not None and isinstance(counts, dict):
                self.on_counts(counts)
        for rank, rep in enumerate(replies, start=1):
            if rep.get("error"):
                raise RuntimeError(f"rank {rank}: {op}: {rep['error']}")
        return replies

    def call(self, op: str, **fields) -> list[dict]:
        """``request`` from a thread other than the event loop's (the trainer's)."""
        return asyncio.run_coroutine_threadsafe(self.request(op, **fields), self.loop).result()

    def submit(self, op: str, **fields):
        """``request`` started from another thread; ``.result()`` waits for the answers."""
        return asyncio.run_coroutine_threadsafe(self.request(op, **fields), self.loop)

    async def close(self) -> None:
        """Tell every rank to stop, then close the links."""
        for link in self.links.values():
            if not link.lost:
                try:
                    await asyncio.wait_for(write_frame(link.writer, {"op": "stop", "id": 0}), 5.0)
                except (ConnectionError, OSError, TimeoutError):
                    pass
        for link in self.links.values():
            if link.task is not None:
                link.task.cancel()
            await close_writer(link.writer)
        if self._server is not None:
            self._server.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class HostShards:
    """The round protocol's view of the other ranks: their shards of each group."""

    def __init__(self, ranks: HostRanks) -> None:
        self.ranks = ranks

    async def reduce(self, group: Group, deadline: float) -> list[bytes]:
        """Every other rank reduces its shard in ``group``; their digests in rank order."""
        seconds = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            replies = await self.ranks.request("reduce", g=group.id, r=group.round, members=group.members,
                                               w=group.weight, t=seconds, lanes=group.lanes_per_part,
                                               owners=group.owners, factors=group.factors)
        except RankLost as e:
            raise RoundFailed("rank_lost", str(e)) from None
        digests = []
        for rep in replies:
            if not rep.get("ok"):
                raise RoundFailed(str(rep.get("reason", "shard_failed"))[:40], str(rep.get("detail", ""))[:200])
            digests.append(rep["digest"])
        return digests

    async def end(self, group: Group, *, committed: bool) -> None:
        """The attempt is over on every shard: kept (its average waits for the outer step) or not."""
        try:
            await self.ranks.request("end", g=group.id, commit=committed)
        except RankLost:
            if committed:
                raise


class HostWorker:
    """Rank 0's worker and the other ranks' behind it, as one worker (see the module docstring).

    What only rank 0 needs (the round, the configs, model info) comes from its own worker."""

    def __init__(self, local: DiLoCoWorker, ranks: HostRanks, shard_hashes: list[str], init_hashes: list[str]) -> None:
        self.local = local
        self.ranks = ranks
        self._hashes = list(shard_hashes)  # ranks 1..N-1, as they last told
        self.init_hash = combined_hash([local.init_hash, *init_hashes])

    def __getattr__(self, name):
        return getattr(self.local, name)

    def _took(self, replies: list[dict]) -> None:
        for rank, rep in enumerate(replies, start=1):
            if "hash" in rep:
                self._hashes[rank - 1] = rep["hash"]

    def fingerprint(self, codec: str, rounds: str = ""):
        return self.local.fingerprint(codec, rounds, init_hash=self.init_hash)

    def params_hash(self) -> str:
        return combined_hash([self.local.params_hash(), *self._hashes])

    def assign_data(self, run_key: str) -> None:
        """Every rank draws its batches by the run's fingerprint digest (each rank by its own
        shard key, ``<peer id>/rank<k>``). Called off the event loop."""
        pending = self.ranks.submit("assign_data", key=run_key)
        self.local.assign_data(run_key)
        pending.result()

    def inner_steps(self, n: int, should_stop=None) -> InnerStats:
        # Every rank trains for rank 0's round from rank 0's step in it (``train_for`` is rank
        # 0's alone): the ranks take the same steps, so their positions stay one.
        sampler = self.local.sampler
        pending = self.ranks.submit("inner_steps", n=n, round=sampler.round, step=sampler.step)
        mine = self.local.inner_steps(n, should_stop)
        replies = pending.result()
        losses = [mine.mean_loss * mine.steps] + [r["loss_sum"] for r in replies]
        return InnerStats(steps=mine.steps, tokens=mine.tokens + sum(r["tokens"] for r in replies),
                          mean_loss=sum(losses) / (mine.steps * len(losses)) if mine.steps else float("nan"),
                          seconds=max([mine.seconds] + [r["seconds"] for r in replies]))

    def pseudo_gradient(self, into=None):
        pending = self.ranks.submit("pseudo_gradient")
        delta = self.local.pseudo_gradient(into)
        pending.result()
        return delta

    def apply_outer(self, avg_delta, *, reset_local: bool = True) -> None:
        """Every rank's outer step on its shard. Overlapped (``reset_local`` False), the ranks'
        inner steps run meanwhile and land it together (``trainer.landing.Landing.host_gate``)."""
        pending = self.ranks.submit("apply_outer", reset=reset_local)
        self.local.apply_outer(avg_delta, reset_local=reset_local)
        self._took(pending.result())

    def start_overlapped(self, own_delta=None) -> None:
        pending = self.ranks.submit("start_overlapped")
        self.local.start_overlapped(own_delta)
        pending.result()

    def land(self) -> None:
        """Every rank lands a committed average now, together (under DDP a collective: one rank
        landing alone, as its checkpoint's ``state_dict`` would, waits for the others forever)."""
        pending = self.ranks.submit("land")
        self.local.land()
        pending.result()

    def reset_local(self) -> None:
        pending = self.ranks.submit("reset_local")
        self.local.reset_local()
        pending.result()

    def eval_loss(self) -> float:
        pending = self.ranks.submit("eval_loss")
        mine = self.local.eval_loss()
        losses = [mine] + [r["loss"] for r in pending.result()]
        return sum(losses) / len(losses)

    def settle(self) -> None:
        self.local.settle()

    # ---- state for joiners, and joining -------------------------------------------------

    def shard_hashes(self) -> tuple[str, ...]:
        """Every rank builds its shard's snapshot of the state it holds (a joiner asked for it);
        the shards' hashes in rank order, which rank 0's snapshot lists."""
        replies = self.ranks.call("publish")
        self._took(replies)
        return (self.local.params_hash(), *(r["hash"] for r in replies))

    async def load_shards(self, snap, donors: list[str], compute) -> bool:
        """Load a downloaded state on every rank, or on none: rank 0's shard (``snap``, from the
        donors' rank 0) lists every shard's hash; each rank fetches its own from the donors'
        matching rank and checks it against that list, and only once all have one do they load."""
        from trainer.diloco import params_digest

        shards = list(snap.shards)
        if len(shards) != self.ranks.world or combined_hash(shards) != snap.params_hash:
            log.warning("a donor's state does not list %d shards hashing to %s; not loading it",
                        self.ranks.world, snap.params_hash[:12])
            return False
        state = await asyncio.to_thread(snap.unpack)
        if await asyncio.to_thread(params_digest, state["params"]) != shards[0]:
            log.warning("rank 0's shard of the downloaded state does not hash to its listed hash")
            return False
        try:
            await self.ranks.request("fetch", round=snap.round, hashes=shards, donors=donors)
        except RuntimeError as e:
            log.warning("a rank could not download its shard: %s", e)
            await self.ranks.request("drop_fetched")
            return False
        # Every rank loads at once: with DDP a load ends in a collective of every rank.
        others = asyncio.ensure_future(self.ranks.request("load_fetched"))
        try:
            await compute(self.local.load_global_state, state)
        finally:
            await asyncio.gather(others, return_exceptions=True)
        self._took(others.result())
        return self.params_hash() == snap.params_hash
