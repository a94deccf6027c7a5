"""Benchmark ``hostranks``: the all-reduce of 2-rank hosts against 1-rank hosts, same model, same link.

Two ``netbed.Testbed`` hosts, each link at ``--rate`` both ways, run real `gonka-node start`
(``--model``, small by default; fp32 codec; ``--min-peers 2``; ``--max-rounds R``), first
with ``--nproc-per-node 1``, then with ``--nproc-per-node 2`` (2 CPU ranks over gloo, FSDP2,
each rank reducing its half of the pseudo-gradient through the host's p2pd in parallel).

Per run: ``allreduce_s`` is the median over rounds 2..R of the all-reduce seconds rank 0 logs
at each commit (every shard's all-reduce and audit, and the vote); ``bound_s`` the link's
bound for a member of a 2-member group, which sends the other its half of the vector and the
average of its own half back (2(M-1)/M = 1 vector of fp32 state up each way), at the ~95.6% of
the nominal rate TCP carries on the testbed; ``ratio`` = allreduce_s / bound_s (goal for
2 ranks: within 1.1x of 1 rank's, and of the bound). ``cpu_s_per_rank_round`` is the CPU time
(user + system) of each of host 0's rank processes, divided by the rounds, the median over
ranks; ``p2pd_cpu_s_round`` the same for its p2pd.

With ``--smoke`` (figures that mean nothing) the two runs share the hosts at the same time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.swarmbench_common import (SCRIPTS, cpu_seconds, log_tail, median, node_argv, process_tree, read_text,
                                          state_bytes, stop_all)

COLUMNS = ["ranks", "model", "rate", "rounds", "allreduce_s", "bound_s", "ratio", "cpu_s_per_rank_round",
           "p2pd_cpu_s_round"]
PORT = 31400
TCP_EFFICIENCY = 0.956  # measured on the testbed (docs/benchmarks.md, allreduce)
ALLREDUCE = re.compile(r"committed round=(\d+) .* allreduce=([0-9.]+)s")
LISTENING = re.compile(r"^listening on (\S+)", re.M)


def add_arguments(group) -> None:
    group.add_argument("--rate", default="100mbit", help="every host's link, both ways (default 100mbit)")
    group.add_argument("--model", choices=["tiny", "small", "base"], help="model preset (default small; tiny with --smoke)")
    group.add_argument("--rounds", type=int,
                       help="rounds per run; round 1 is left out (default 6; 3 with --quick, 2 with --smoke)")
    group.add_argument("--inner-steps", type=int, help="inner steps per round (default 2; 1 with --smoke)")
    group.add_argument("--prefix", default="ghr", help="testbed name prefix (default ghr)")


def _kind(pid: int) -> str:
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd":
            return "p2pd"
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return "rank" if any(e.startswith(b"RANK=") for e in env) else "other"


def run_ranks(tb, ranks: int, args, workdir: Path) -> dict:
    run_id = f"hr{os.getpid()}r{ranks}"
    port = PORT + ranks
    logs = [workdir / f"r{ranks}-host{i}.log" for i in range(2)]
    extra = ["--nproc-per-node", str(ranks), "--set", "data.eval_every=0", "--set", "swarm.codec=fp32"]
    procs = []
    usage: dict[int, tuple[str, float]] = {}  # pid -> (kind, last CPU seconds seen)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if procs:
                for pid in process_tree(procs[0].pid):
                    seconds = cpu_seconds(pid)
                    if seconds is not None:
                        kind = usage[pid][0] if pid in usage else ("rank" if ranks == 1 and pid == procs[0].pid
                                                                   else _kind(pid))
                        usage[pid] = (kind, seconds)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for i in range(2):
            (workdir / f"r{ranks}-host{i}").mkdir()
            bootstrap = None
            if i:
                m = None
                deadline = time.monotonic() + 300
                while m is None and time.monotonic() < deadline and procs[0].poll() is None:
                    m = LISTENING.search(read_text(logs[0]))
                    time.sleep(0.2)
                if m is None:
                    raise RuntimeError(f"host 0 never listened:\n{log_tail(logs[0])}")
                bootstrap = m.group(1)
            argv = node_argv(ip=tb.host_ip(i), port=port, run_id=run_id, workdir=workdir / f"r{ranks}-host{i}",
                             model=args.model, inner_steps=args.inner_steps, min_peers=2, max_rounds=args.rounds,
                             bootstrap=bootstrap, extra=extra)
            with open(logs[i], "wb") as f:
                procs.append(tb.run(i, argv, stdout=f, stderr=subprocess.STDOUT, cwd=workdir))
        for p, log in zip(procs, logs):
            if p.wait(120 + 120 * args.rounds) != 0:
                raise RuntimeError(f"{log.name} exited {p.returncode}:\n{log_tail(log)}")
    finally:
        done.set()
        sampler.join()
        stop_all(procs, grace=5)
    seconds = [float(s) for r, s in ALLREDUCE.findall(read_text(logs[0])) if int(r) > 1]
    if not seconds:
        raise RuntimeError(f"no commits after round 1 in {logs[0]}:\n{log_tail(logs[0])}")
    rate_bps = _bits_per_second(args.rate)
    bound = state_bytes(args.model) / 2 * 8 / (rate_bps * TCP_EFFICIENCY)  # θ's half of the state: one vector
    rank_cpu = [s for kind, s in usage.values() if kind == "rank"]
    p2pd_cpu = [s for kind, s in usage.values() if kind == "p2pd"]
    return {"ranks": ranks, "model": args.model, "rate": args.rate, "rounds": args.rounds,
            "allreduce_s": median(seconds), "bound_s": bound, "ratio": median(seconds) / bound,
            "cpu_s_per_rank_round": median(rank_cpu) / args.rounds if rank_cpu else None,
            "p2pd_cpu_s_round": sum(p2pd_cpu) / args.rounds if p2pd_cpu else None}


def _bits_per_second(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"--rate: expected e.g. 100mbit (got {rate!r})")


def run(args) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import netbed

    smoke = getattr(args, "smoke", False)
    args.model = args.model or ("tiny" if smoke else "small")
    args.rounds = args.rounds or (2 if smoke else 3 if args.quick else 6)
    args.inner_steps = args.inner_steps or (1 if smoke else 2)
    if args.rounds < 2 or args.inner_steps < 1:
        raise ValueError("--rounds must be >= 2 (round 1 is left out), --inner-steps >= 1")
    netbed.parse_rate(args.rate)
    workdir = Path(tempfile.mkdtemp(prefix="hostranks-"))
    rows = []
    try:
        with netbed.Testbed(2, rate=args.rate, prefix=f"{args.prefix}{os.getpid() % 100000}") as tb:
            if smoke:  # side by side on the same two hosts (ports and run ids of their own): half the wall
                with ThreadPoolExecutor(2) as pool:
                    rows = list(pool.map(lambda ranks: run_ranks(tb, ranks, args, workdir), (1, 2)))
            else:
                rows = [run_ranks(tb, ranks, args, workdir) for ranks in (1, 2)]
            for row in rows:
                print(f"hostranks: {row}", file=sys.stderr, flush=True)
    finally:
        shutil.copytree(workdir, args.out / "hostranks-logs", dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    one, two = rows
    notes = [f"2-rank host / 1-rank host all-reduce: {two['allreduce_s'] / one['allreduce_s']:.2f}x "
             f"({two['allreduce_s']:.2f} vs {one['allreduce_s']:.2f} s; link bound {one['bound_s']:.2f} s)"]
    return {"rows": rows, "columns": COLUMNS, "notes": notes, "load_average": os.getloadavg()}
