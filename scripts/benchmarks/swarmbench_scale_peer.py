"""Light peers for the ``scale`` benchmark: several Swarm + RoundProtocol instances in one process.

A full `gonka-node` process holds ~550 MB and a torch model; 32 of them do
not fit a 2-core machine. A light peer is what the round protocol sees of a
node — its own p2pd, DHT node, heartbeat and ``RoundProtocol`` — averaging
a synthetic pseudo-gradient of the tiny model's size instead of training.

Run by ``scale.py`` (one process per ``--count`` peers, all on loopback):
process 0 starts peer 0 and writes its multiaddrs to ``WORKDIR/bootstrap``;
every other peer bootstraps from it. Each process then waits until each of
its peers sees all the others in the peer table, writes ``visible-I``, and
between rounds meets the other processes at a file barrier (``done-R-I``),
so every round starts with all peers ready at once. Results go to
``WORKDIR/peers-I.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: its benchmarks package

import torch  # noqa: E402

from benchmarks.swarmbench_common import rss_bytes  # noqa: E402
from node.metrics import NodeMetrics  # noqa: E402
from p2p.config import SwarmConfig  # noqa: E402
from p2p.rounds import RoundProtocol  # noqa: E402
from p2p.swarm import Swarm  # noqa: E402

MAX_ATTEMPTS = 5  # attempts per round before this peer gives the round up


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (a p2pd child), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class LightPeer:
    """One peer: swarm membership, round protocol, and a record of lookup times."""

    def __init__(self, index: int, swarm: Swarm, rounds: RoundProtocol):
        self.index = index
        self.swarm = swarm
        self.rounds = rounds
        self.lookups: list[float] = []  # seconds of every peer-table read during the rounds
        self.records: list[dict] = []
        original = swarm.refresh_peers

        async def timed_refresh(max_age: float = 0.0):
            started = time.perf_counter()
            try:
                return await original(max_age)
            finally:
                if not max_age:
                    self.lookups.append(time.perf_counter() - started)

        swarm.refresh_peers = timed_refresh

    async def one_round(self, r: int, numel: int, deadline: float) -> dict:
        generator = torch.Generator().manual_seed(1000 * self.index + r)
        delta = [torch.randn(numel, generator=generator)]
        t_enter = time.time()
        attempts = 0
        result = None
        reasons = []  # why each failed attempt ended
        while attempts < MAX_ATTEMPTS and time.time() < deadline:
            attempts += 1
            result = await self.rounds.average(delta, 1.0, r)
            if result is None:
                reasons.append(self.rounds.last.reason or self.rounds.last.status)
            if result is not None or self.rounds.last.status == "behind":
                break
            await asyncio.sleep(0.5)
        last = self.rounds.last
        digest = hashlib.sha256(result[0].numpy().tobytes()).hexdigest()[:16] if result is not None else None
        # What a node does after a commit: announce the new round (and hash) in the peer table.
        self.swarm.announce(state="training", round=r + 1, hash=digest or "")
        return {"round": r, "t_enter": t_enter, "t_exit": time.time(), "status": last.status, "reasons": reasons,
                "attempts": attempts, "gather_seconds": last.gather_seconds, "allreduce_seconds": last.allreduce_seconds,
                "members": len(last.members), "digest": digest}


async def wait_file(path: Path, deadline: float) -> str:
    while time.time() < deadline:
        if path.exists():
            return path.read_text()
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{path.name} did not appear")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def main(args) -> None:
    deadline = time.time() + args.timeout
    workdir = Path(args.workdir)
    cfg = dict(min_peers=args.total, heartbeat_interval=args.heartbeat, gather_timeout=60.0, round_timeout=60.0,
               request_timeout=15.0)
    peers: list[LightPeer] = []
    started = time.time()
    try:
        for index in range(args.first, args.first + args.count):
            if index == 0:
                bootstrap = []
            else:
                bootstrap = json.loads(await wait_file(workdir / "bootstrap", deadline))
            metrics = NodeMetrics()
            swarm = await Swarm.start(SwarmConfig(bootstrap=bootstrap, **cfg), args.run_id, identity_path=None,
                                      on_reject=lambda reason, m=metrics: m.rejected_messages.labels(reason=reason).inc())
            rounds = RoundProtocol(swarm, metrics)
            await rounds.start()
            swarm.announce(state="training", round=0, hash="h0")
            peers.append(LightPeer(index, swarm, rounds))
            if index == 0:
                write_atomic(workdir / "bootstrap", json.dumps(swarm.maddrs))
        startup_seconds = time.time() - started

        # Everyone visible to everyone: the rounds then measure the protocol, not the start-up.
        visible_at = None
        while time.time() < deadline:
            tables = await asyncio.gather(*(p.swarm.refresh_peers() for p in peers))
            if all(len(t) >= args.total - 1 for t in tables):
                visible_at = time.time()
                break
            await asyncio.sleep(0.5)
        if visible_at is None:
            raise TimeoutError("peers never saw all the others")
        idle_lookups = [x for p in peers for x in p.lookups]
        for p in peers:
            p.lookups.clear()
        write_atomic(workdir / f"visible-{args.first}", "1")
        await wait_file(workdir / "go", deadline)

        processes = [int(x) for x in args.processes.split(",")]
        my_pids = [os.getpid()] + [p.swarm.p2pd_pid for p in peers if p.swarm.p2pd_pid]
        cpu0, wall0 = sum(cpu_seconds(pid) for pid in my_pids), time.time()
        for r in range(args.rounds):
            records = await asyncio.gather(*(p.one_round(r, args.numel, deadline) for p in peers))
            for p, rec in zip(peers, records):
                p.records.append(rec)
            write_atomic(workdir / f"done-{r}-{args.first}", "1")
            for first in processes:  # barrier: the next round starts when every peer finished this one
                await wait_file(workdir / f"done-{r}-{first}", deadline)
        cpu1, wall1 = sum(cpu_seconds(pid) for pid in my_pids), time.time()
        result = {
            "first": args.first, "count": args.count, "startup_seconds": startup_seconds,
            "idle_lookups": idle_lookups, "cpu_seconds": cpu1 - cpu0, "wall_seconds": wall1 - wall0,
            "python_rss_bytes": rss_bytes(os.getpid()), "python_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "p2pd_rss_bytes": sum(rss_bytes(p.swarm.p2pd_pid) for p in peers if p.swarm.p2pd_pid),
            "peers": [{"index": p.index, "peer_id": p.swarm.peer_id, "rounds": p.records, "lookups": p.lookups}
                      for p in peers],
        }
        write_atomic(workdir / f"peers-{args.first}.json", json.dumps(result))
        # Stay until every process wrote its result: leaving early would look like a dead peer to the others.
        for first in processes:
            await wait_file(workdir / f"peers-{first}.json", deadline)
    finally:
        await asyncio.gather(*(p.swarm.close() for p in peers), return_exceptions=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--first", type=int, required=True, help="global index of this process's first peer")
    p.add_argument("--count", type=int, required=True, help="peers in this process")
    p.add_argument("--total", type=int, required=True, help="peers in the swarm (= min_peers)")
    p.add_argument("--processes", required=True, help="comma-separated --first of every process (for the barriers)")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--numel", type=int, required=True, help="fp32 values averaged per round")
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--run-id", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--timeout", type=float, required=True, help="seconds this process may live")
    args = p.parse_args()
    torch.set_num_threads(1)
    asyncio.run(main(args))
