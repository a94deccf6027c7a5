"""Benchmark ``scale``: round and group-formation time as the swarm grows to M peers (loopback).

For each M in ``--sizes`` (default 8,16,32; 4,8 with --quick) a swarm of M
*light peers* runs ``--rounds`` rounds with ``min_peers = M``. A light peer
is one ``Swarm`` (its own p2pd and DHT node) plus one ``RoundProtocol``,
averaging a synthetic fp32 pseudo-gradient of the tiny model's size
(``--numel``); several of them share one Python process
(``--peers-per-process``, see ``swarmbench_scale_peer.py``): 32 full
`gonka-node` processes (~550 MB and a torch model each) do not fit a 2-core
machine, and training would only blur the network numbers.

All peers of a round enter it at once (a barrier between rounds), so per round:

- ``round_s``: from the last peer entering ``average`` to the last peer
  holding the committed result (group formation + all-reduce + vote);
- ``gather_s``: ``RoundOutcome.gather_seconds`` of the last peer to enter
  (matchmaking once everyone is ready: peer-table polls, the leader's begin);
- ``allreduce_s``: the slowest member's ``RoundOutcome.allreduce_seconds``.

The table shows medians over rounds. ``lookup_ms`` is the median (and
``lookup_p90_ms`` the 90th percentile) of one peer-table read
(``Swarm.refresh_peers``, one DHT get of the run's key with M subkeys)
during the rounds; ``lookup_idle_ms`` the same before the rounds, with the
swarm idle. ``all_committed``: every peer committed every round, and all M
results of each round are bit-identical. ``cpu_cores`` is CPU seconds of the
peer processes and their p2pds during the rounds per wall second (2 is all
of this machine), ``rss_mb`` their total resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.swarmbench_common import ROOT, median, state_numel

PEER_SCRIPT = Path(__file__).resolve().parent / "swarmbench_scale_peer.py"
COLUMNS = ["peers", "processes", "rounds", "round_s", "gather_s", "allreduce_s", "lookup_ms", "lookup_p90_ms",
           "lookup_idle_ms", "all_committed", "attempts", "startup_s", "cpu_cores", "rss_mb"]


def sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not sizes or any(m < 2 or m > 64 for m in sizes):
        raise argparse.ArgumentTypeError(f"every size must be 2-64, got {text!r}")
    return sizes


def add_arguments(group) -> None:
    group.add_argument("--sizes", type=sizes_arg,
                       help="swarm sizes M, comma-separated (default 8,16,32; 4,8 with --quick, 2,3 with --smoke)")
    group.add_argument("--rounds", type=int, help="rounds per size (default 3; 2 with --quick, 1 with --smoke)")
    group.add_argument("--numel", type=int, help="fp32 values averaged per round (default: the tiny model's parameters; "
                                                 "65,536 with --smoke)")
    group.add_argument("--peers-per-process", type=int, default=8, help="light peers per Python process (default 8)")
    group.add_argument("--heartbeat", type=float, default=2.0,
                       help="swarm.heartbeat_interval of the peers (default 2.0 s, the node's default; at 1.0 s and "
                            "M=32 on 2 cores heartbeats expired faster than lookups returned and rounds stalled)")
    group.add_argument("--size-timeout", type=float, help="seconds one size may take (default 60 + 8 s per peer + 30 s per round)")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_size(m: int, args, tag: str) -> dict:
    """Start M light peers in ceil(M / per-process) processes, wait for their results, summarize."""
    workdir = Path(tempfile.mkdtemp(prefix=f"scale-{m}-"))
    firsts = list(range(0, m, args.peers_per_process))
    timeout = args.size_timeout or 60 + 8 * m + 30 * args.rounds
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    procs, logs = [], []
    try:
        for first in firsts:
            argv = [sys.executable, str(PEER_SCRIPT), "--first", str(first),
                    "--count", str(min(args.peers_per_process, m - first)), "--total", str(m),
                    "--processes", ",".join(map(str, firsts)), "--rounds", str(args.rounds), "--numel", str(args.numel),
                    "--heartbeat", str(args.heartbeat), "--run-id", f"scale{os.getpid()}{tag}",
                    "--workdir", str(workdir), "--timeout", str(timeout)]
            log = workdir / f"proc-{first}.log"
            logs.append(log)
            with open(log, "wb") as f:
                # Own session: the whole group (and the p2pds, which die with their parent) goes at the end.
                procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env, start_new_session=True))
        deadline = time.monotonic() + timeout + 15
        started = time.monotonic()
        while not all((workdir / f"visible-{f}").exists() for f in firsts):
            failed(procs, logs, deadline, m, "waiting for the peers to see each other")
            time.sleep(0.1)
        startup = time.monotonic() - started
        (workdir / "go").write_text("1")
        while not all((workdir / f"peers-{f}.json").exists() for f in firsts):
            failed(procs, logs, deadline, m, "running the rounds")
            time.sleep(0.1)
        results = [json.loads((workdir / f"peers-{f}.json").read_text()) for f in firsts]
        for p in procs:  # they close their swarms and exit by themselves
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        return summarize(m, results, args, startup, len(firsts))
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def failed(procs, logs, deadline: float, m: int, doing: str) -> None:
    for p, log in zip(procs, logs):
        if p.poll() not in (None, 0):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"M={m}: a peer process exited with {p.returncode} while {doing}:\n{tail}")
    if time.monotonic() > deadline:
        tail = "\n".join(logs[0].read_text(errors="replace").splitlines()[-8:])
        raise RuntimeError(f"M={m}: timed out {doing}; last lines of process 0:\n{tail}")


def summarize(m: int, results: list[dict], args, startup: float, processes: int) -> dict:
    peers = [p for r in results for p in r["peers"]]
    per_round = []
    all_committed = True
    for r in range(args.rounds):
        recs = [p["rounds"][r] for p in peers]
        last_in = max(recs, key=lambda x: x["t_enter"])
        committed = all(x["status"] == "committed" and x["members"] == m for x in recs)
        identical = len({x["digest"] for x in recs}) == 1 and recs[0]["digest"] is not None
        all_committed &= committed and identical
        per_round.append({"round": r, "round_s": max(x["t_exit"] for x in recs) - last_in["t_enter"],
                          "gather_s": last_in["gather_seconds"], "allreduce_s": max(x["allreduce_seconds"] for x in recs),
                          "enter_spread_s": last_in["t_enter"] - min(x["t_enter"] for x in recs),
                          "committed": committed, "identical": identical,
                          "attempts": max(x["attempts"] for x in recs),
                          "reasons": sorted({why for x in recs for why in x["reasons"]})})
    lookups = [x for p in peers for x in p["lookups"]]
    idle = [x for r in results for x in r["idle_lookups"]]
    wall = max(r["wall_seconds"] for r in results)
    return {
        "peers": m, "processes": processes, "rounds": args.rounds,
        "round_s": median(x["round_s"] for x in per_round),
        "gather_s": median(x["gather_s"] for x in per_round),
        "allreduce_s": median(x["allreduce_s"] for x in per_round),
        "lookup_ms": 1000 * statistics.median(lookups) if lookups else None,
        "lookup_p90_ms": 1000 * percentile(lookups, 0.9) if lookups else None,
        "lookup_idle_ms": 1000 * statistics.median(idle) if idle else None,
        "lookups_per_s": len(lookups) / wall if wall else None,
        "all_committed": all_committed,
        "attempts": max(x["attempts"] for x in per_round),
        "startup_s": startup,
        "cpu_cores": sum(r["cpu_seconds"] for r in results) / wall if wall else None,
        "rss_mb": sum(r["python_rss_bytes"] + r["p2pd_rss_bytes"] for r in results) / 1e6,
        "per_round": per_round,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("round_s") is not None]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs = [r["peers"] for r in ok]
    for key, label in (("round_s", "round (last ready -> last committed)"), ("gather_s", "gather / group formation"),
                       ("allreduce_s", "all-reduce + vote")):
        ax.plot(xs, [r[key] for r in ok], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("peers M (min_peers = M)")
    ax.set_ylabel("seconds (median over rounds)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    smoke = getattr(args, "smoke", False)
    args.sizes = args.sizes or ([2, 3] if smoke else [4, 8] if args.quick else [8, 16, 32])
    args.rounds = args.rounds or (1 if smoke else 2 if args.quick else 3)
    args.numel = args.numel or (1 << 16 if smoke else state_numel("tiny"))
    if args.rounds < 1 or args.numel < 1 or args.peers_per_process < 1:
        raise ValueError("--rounds, --numel and --peers-per-process must be >= 1")
    rows, notes = [], []
    for k, m in enumerate(args.sizes):
        print(f"scale: {m} light peers, {args.rounds} rounds of {args.numel:,} fp32 ...", file=sys.stderr, flush=True)
        try:
            row = run_size(m, args, str(k))
        except RuntimeError as e:
            notes.append(f"FAILED {e}")
            print(f"scale: {e}", file=sys.stderr, flush=True)
            rows.append({"peers": m, "all_committed": False, "error": str(e).splitlines()[0]})
            continue
        rows.append(row)
        if not row["all_committed"]:
            notes.append(f"M={m}: not every peer committed every round with identical results: {row['per_round']}")
    png = args.out / "scale.png"
    plot(rows, png, f"light peers on loopback, {args.numel:,} fp32 per round, {os.cpu_count()} CPUs")
    notes.append(f"plot: {png}")
    notes.append(f"light peers: Swarm + RoundProtocol, {args.peers_per_process} per process, synthetic deltas; "
                 "all processes share this machine's CPUs, so large M measures CPU contention as much as the protocol")
    return {"rows": rows, "columns": COLUMNS, "notes": notes, "plot": str(png),
            "config": {"sizes": args.sizes, "rounds": args.rounds, "numel": args.numel,
                       "peers_per_process": args.peers_per_process, "heartbeat": args.heartbeat},
            "load_average": os.getloadavg()}
