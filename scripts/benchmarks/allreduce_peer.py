"""One peer of the ``allreduce`` benchmark, run inside one testbed host by ``allreduce.py``.

Every peer of a run gets the same arguments except ``--index`` and ``--ip``.
It builds its own pseudo-gradient (seeded normal fp32 of ``--params``
elements, a different seed per peer), meets the others, averages it
``--repeats`` times with one system (gonka-node's RoundProtocol, hivemind's
DecentralizedAverager or torch.distributed gloo), and writes what it measured
to ``WORKDIR/peer<index>.json``. The coordinator reads those files; this
process never prints results.

Peers synchronise through files in the shared WORKDIR (the namespaces share
the file system): peer 0 publishes its multiaddrs there, and a file barrier
before every repeat makes all peers enter the averaging call within a few
milliseconds of each other. Times are ``time.time()`` (one clock for every
namespace), so the coordinator can take "last peer in -> last peer out".

The whole process is bounded by ``--timeout``: past it, faulthandler dumps
every thread's stack to stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

POLL = 0.005  # seconds between two looks at the barrier files
MAX_RETRIES = 2  # aborted gonka-node attempts retried per repeat before the peer gives up


# ---- helpers shared by the three systems ------------------------------------------


def nic_tx_bytes(dev: str = "eth0") -> int:
    """Bytes sent by this namespace's interface (/proc/net/dev is per network namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == dev:
            return int(fields.split()[8])
    return 0


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default), all threads included."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def wait_for_file(path: Path, deadline: float) -> None:
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"{path.name} did not appear")
        time.sleep(POLL)


def barrier(workdir: Path, name: str, index: int, peers: int, deadline: float) -> None:
    """Return once every peer has reached barrier ``name``."""
    (workdir / f"barrier-{name}-{index}").touch()
    for i in range(peers):
        wait_for_file(workdir / f"barrier-{name}-{i}", deadline)


async def abarrier(workdir: Path, name: str, index: int, peers: int, deadline: float) -> None:
    """``barrier`` that keeps the event loop (heartbeats, stream handlers) running."""
    (workdir / f"barrier-{name}-{index}").touch()
    for i in range(peers):
        while not (workdir / f"barrier-{name}-{i}").exists():
            if time.time() > deadline:
                raise TimeoutError(f"barrier {name}: peer {i} never arrived")
            await asyncio.sleep(POLL)


_BACKGROUND: set = set()  # tasks the peer keeps running (a reference, so none is collected)


def tune_allocator() -> None:
    """The allocator policy a node's daemon sets at start (older trees have no such module)."""
    try:
        from node.allocator import tune_malloc
    except ImportError:
        return
    tune_malloc()


def peer0_addresses(workdir: Path, index: int, deadline: float) -> list[str]:
    """What a peer bootstraps from: peer 0's addresses (``joined_rounds`` writes them), none for peer 0."""
    if index == 0:
        return []
    addr_file = workdir / "peer0.maddrs"
    wait_for_file(addr_file, deadline)
    return json.loads(addr_file.read_text())


async def joined_rounds(swarm, metrics, workdir: Path, index: int, peers: int, deadline: float):
    """This peer's round protocol, once its peer table holds every other peer (peer 0 publishes
    its addresses first)."""
    from p2p.rounds import RoundProtocol

    if index == 0:
        write_json(workdir / "peer0.maddrs", swarm.maddrs)
    write_json(workdir / f"peer{index}.id", swarm.peer_id)
    rounds = RoundProtocol(swarm, metrics)
    await rounds.start()
    if hasattr(rounds, "reachability") and hasattr(rounds.reachability, "run"):
        # As a node does: asks whether it can be dialled, and behind NAT stays connected to the
        # peers that can (the task lives as long as the loop; older trees have no such check).
        check = rounds.reachability.run(swarm.config.heartbeat_interval)
        _BACKGROUND.add(asyncio.get_running_loop().create_task(check))
    swarm.announce(state="training", round=0, hash="")
    while len(await swarm.refresh_peers()) < peers - 1:
        if time.time() > deadline:
            raise TimeoutError(f"peer table shows {len(swarm.peers)} of {peers - 1} other peers")
        await asyncio.sleep(0.1)
    return rounds


def make_input(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def digest(x: torch.Tensor) -> str:
    return hashlib.blake2b(x.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def check_result(result: torch.Tensor, args, aggregator: str = "mean", owns: list[bool] | None = None,
                 order: list[int] | None = None) -> dict:
    """Error of the averaged vector against what the peers were asked to compute from every peer's
    input: the exact mean, or (gonka-node) the swarm's aggregator on uncompressed pieces, cut as
    the group cut them: ``order`` the peers' indices in member order, ``owns`` which owned a part."""
    if aggregator == "mean":
        mean = torch.zeros(args.params, dtype=torch.float64)
        for i in range(args.peers):
            mean += make_input(args.seed + i, args.params).double()
        mean /= args.peers
    else:
        from p2p.codecs import get_codec
        from p2p.compression import SwarmAverage

        inputs = [([make_input(args.seed + i, args.params)], 1.0) for i in order or range(args.peers)]
        mean = SwarmAverage(aggregator, get_codec(args.codec), owns=owns)(inputs)[0].double()
    diff = result.double() - mean
    return {"rel_error": float(diff.norm() / mean.norm()), "max_abs_error": float(diff.abs().max())}


# ---- gonka-node -------------------------------------------------------------------


async def run_gonka(args, x: torch.Tensor, deadline: float) -> dict:
    from node.metrics import NodeMetrics
    from p2p.config import SwarmConfig
    from p2p.swarm import Swarm

    tune_allocator()
    workdir = Path(args.workdir)
    bootstrap = peer0_addresses(workdir, args.index, deadline)
    options = dict(
        bootstrap=bootstrap,
        listen=[f"/ip4/{args.ip}/tcp/0"],
        min_peers=args.peers,
        heartbeat_interval=2.0,
        gather_timeout=args.timeout,
        round_timeout=args.timeout,
        request_timeout=20.0,
    )
    if "codec" in SwarmConfig.__dataclass_fields__:
        # Off by default: one sync of the same vector each repeat (error feedback changes later inputs).
        options.update(codec=args.codec, error_feedback=args.error_feedback)
    elif args.codec != "fp32":
        raise SystemExit(f"this SwarmConfig has no codec field; cannot run codec {args.codec}")
    metrics = NodeMetrics()
    swarm = await Swarm.start(SwarmConfig(**options), f"bench-{args.run_tag}", identity_path=None,
                              on_reject=lambda reason: metrics.rejected_messages.labels(reason=reason).inc())
    try:
        rounds = await joined_rounds(swarm, metrics, workdir, args.index, args.peers, deadline)
        await abarrier(workdir, "joined", args.index, args.peers, deadline)
        repeats, result = [], None
        given = x.clone()
        for r in range(args.warmup + args.repeats):
            # As a node does: the round takes a vector of its own (donated), which holds the
            # average after it, or with error feedback becomes the residual's vector.
            x = given.clone()
            await abarrier(workdir, f"round{r}", args.index, args.peers, deadline)
            sent0 = metrics.registry.get_sample_value("gonka_node_sent_bytes_total") or 0.0
            nic0 = nic_tx_bytes()
            cpu0, p2pd0 = cpu_seconds(), cpu_seconds(swarm.p2pd_pid)
            t_enter = time.time()
            aborted = []
            # An aborted attempt is retried, as the node does; its time stays in this repeat's.
            while (out := await rounds.average([x], 1.0, r, donate=True)) is None:
                last = rounds.last
                aborted.append({"status": last.status, "reason": last.reason, "allreduce_s": last.allreduce_seconds})
                print(f"round {r}: attempt {len(aborted)} {last.status} ({last.reason}) after "
                      f"{last.allreduce_seconds:.1f}s", file=sys.stderr, flush=True)
                if last.status != "aborted" or len(aborted) > MAX_RETRIES:
                    raise RuntimeError(f"round {r} did not commit: {last}")
            t_commit = time.time()
            result = out.decoded()[0]  # the average is decoded as it is read: a node's outer step reads it
            t_exit = time.time()
            sent = (metrics.registry.get_sample_value("gonka_node_sent_bytes_total") or 0.0) - sent0
            repeats.append({"t_enter": t_enter, "t_commit": t_commit, "t_exit": t_exit, "allreduce_s": rounds.last.allreduce_seconds,
                            "gather_s": rounds.last.gather_seconds, "members": len(rounds.last.members),
                            "phases": getattr(rounds.last, "phases", {}),
                            "sent_bytes": int(sent), "nic_tx_bytes": nic_tx_bytes() - nic0,
                            "cpu_s": cpu_seconds() - cpu0, "p2pd_cpu_s": cpu_seconds(swarm.p2pd_pid) - p2pd0,
                            "digest": digest(result), "aborted": aborted})
        # Leave only once everyone is done: a member that closes early could fail a slow vote.
        await abarrier(workdir, "done", args.index, args.peers, deadline)
        # The very first sync's aborted attempts, warm-up or not: peers that start together must
        # commit their first round at the first attempt, however far apart they are.
        ids = [json.loads((workdir / f"peer{i}.id").read_text()) for i in range(args.peers)]
        order = sorted(range(args.peers), key=ids.__getitem__)  # members are sorted by peer id
        owners = getattr(rounds.last, "owners", [])
        return {"repeats": repeats[args.warmup :], "first_sync_aborted": len(repeats[0]["aborted"]),
                "owners": len(owners), **check_result(result, args, rounds.aggregator,
                                                      [not owners or ids[i] in owners for i in order], order)}
    finally:
        await swarm.close()


# ---- hivemind ------------------------------------------------------------------------


def run_hivemind(args, x: torch.Tensor, deadline: float) -> dict:
    import hivemind
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression, NoCompression

    workdir = Path(args.workdir)
    addr_file = workdir / "peer0.maddrs"
    initial: list[str] = []
    if args.index > 0:
        wait_for_file(addr_file, deadline)
        initial = json.loads(addr_file.read_text())
    # docs/design.md network rules: DHT forwards these to P2P.create (no UPnP, AutoNAT, relays, IPFS).
    dht = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=[f"/ip4/{args.ip}/tcp/0"],
                       nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False,
                       use_ipfs=False)
    averager = None
    try:
        if args.index == 0:
            write_json(addr_file, [str(a) for a in dht.get_visible_maddrs()])
        compression = {"none": NoCompression(), "float16": Float16Compression()}[args.codec]
        averager = hivemind.DecentralizedAverager(
            [x.clone()], dht, start=True, prefix=f"bench{args.run_tag}", target_group_size=args.peers,
            min_group_size=args.peers, min_matchmaking_time=2.0, request_timeout=1.0,
            compression=compression, allreduce_timeout=args.timeout)
        barrier(workdir, "joined", args.index, args.peers, deadline)
        repeats, result = [], None
        for r in range(args.warmup + args.repeats):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(x)
            barrier(workdir, f"round{r}", args.index, args.peers, deadline)
            nic0 = nic_tx_bytes()
            t_enter = time.time()
            # Matchmaking first, all-reduce on our trigger: so the all-reduce is timed on its own.
            control = averager.step(wait=False, require_trigger=True, timeout=max(1.0, deadline - time.time()))
            while control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) and not control.done():
                if time.time() > deadline:
                    raise TimeoutError("hivemind matchmaking did not finish")
                time.sleep(POLL)
            t_grouped = time.time()
            control.allow_allreduce()
            info = control.result(timeout=max(1.0, deadline - time.time()))
            # The average is in the averager's tensors as the step returns: nothing is left to
            # decode, so its commit and its exit are one moment (gonka-node decodes after it).
            t_commit = t_exit = time.time()
            if info is None:
                raise RuntimeError(f"hivemind step {r} failed")
            with averager.get_tensors() as tensors:
                result = tensors[0].clone()
            repeats.append({"t_enter": t_enter, "t_commit": t_commit, "t_exit": t_exit, "allreduce_s": t_exit - t_grouped,
                            "members": len(info), "sent_bytes": None, "nic_tx_bytes": nic_tx_bytes() - nic0,
                            "digest": digest(result)})
        barrier(workdir, "done", args.index, args.peers, deadline)
        return {"repeats": repeats[args.warmup :], **check_result(result, args)}
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


# ---- torch.distributed gloo ----------------------------------------------------------


def run_gloo(args, x: torch.Tensor, deadline: float) -> dict:
    import datetime

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the testbed link, never loopback
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.index,
                            world_size=args.peers, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        repeats, result = [], None
        for r in range(args.warmup + args.repeats):
            t = x.clone()
            dist.barrier()
            nic0 = nic_tx_bytes()
            t_enter = time.time()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
            t_commit = time.time()  # every peer holds the sum; the division makes it the mean
            t.div_(args.peers)
            t_exit = time.time()
            result = t
            repeats.append({"t_enter": t_enter, "t_commit": t_commit, "t_exit": t_exit, "allreduce_s": t_exit - t_enter,
                            "members": args.peers, "sent_bytes": None, "nic_tx_bytes": nic_tx_bytes() - nic0,
                            "digest": digest(result)})
        dist.barrier()
        return {"repeats": repeats[args.warmup :], **check_result(result, args)}
    finally:
        dist.destroy_process_group()


# ---- entry point -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one peer of the allreduce benchmark (started by allreduce.py)")
    p.add_argument("--mode", choices=["gonka", "hivemind", "gloo"], required=True)
    p.add_argument("--index", type=int, required=True, help="this peer's number, 0..peers-1")
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--ip", required=True, help="this host's testbed address (behind NAT: its own, private one)")
    p.add_argument("--master", help="gloo: host 0's address")
    p.add_argument("--port", type=int, default=29500, help="gloo: rendezvous port on host 0")
    p.add_argument("--workdir", required=True, help="directory shared by the peers of this run")
    p.add_argument("--params", type=int, required=True, help="elements of the fp32 pseudo-gradient")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0, help="untimed syncs before the timed ones (not reported)")
    p.add_argument("--codec", default="fp32")
    p.add_argument("--error-feedback", action="store_true", help="gonka: keep error feedback on (lossy codecs)")
    p.add_argument("--seed", type=int, default=1000, help="peer i uses seed + i")
    p.add_argument("--run-tag", default="0", help="makes DHT keys and prefixes unique to this run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds this process may live")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # the hard bound on this process
    deadline = time.time() + args.timeout - 5
    # Several peers share the machine's cores: one intra-op thread each, no oversubscription.
    torch.set_num_threads(1)
    x = make_input(args.seed + args.index, args.params)
    out = Path(args.workdir) / f"peer{args.index}.json"
    started = time.time()
    if args.mode == "gonka":
        import uvloop  # the event loop a gonka-node runs on (node/daemon.py)

        result = uvloop.run(run_gonka(args, x, deadline))
    elif args.mode == "hivemind":
        result = run_hivemind(args, x, deadline)
    else:
        result = run_gloo(args, x, deadline)
    write_json(out, {"index": args.index, "mode": args.mode, "codec": args.codec, "ok": True,
                     "seconds_alive": time.time() - started, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
