"""Benchmark ``utilization``: the share of wall time a node spends in inner steps, per overlap mode.

For each mode of ``--overlap`` (default ``off,eager``), one after the other
on the same ``netbed.Testbed``, ``--nodes`` real `gonka-node start`
processes (``--min-peers`` = nodes, ``--max-rounds`` = ``--rounds`` = R,
``--overlap MODE``) train at ``--rate``. Every node gets
``--set data.eval_every=R``: evaluation is a user's choice, not time lost to
the network, so it runs once, after the last round, outside the window below.

Utilization comes from the node's own log, which is exact. At the end of each
phase of inner steps a node logs
``trained round=K steps=N seconds=S loss=L``: the timestamp is the end of the
phase, ``S`` its length, so it started at ``end − S``. Phase k is the k-th
such line (its work goes into round k; overlapped, a node trains one phase
more than R, whose work is never sent). Over phases 2..R, the ones that fed
committed rounds, leaving out phase 1 because it absorbs the swarm's start-up
skew:

    utilization = Σ S_k / (end of phase R − start of phase 2)

Per node: ``train_seconds`` = Σ S_k, ``wall_seconds`` = the denominator,
``wait_seconds`` = wall − train (what the node spent between phases: its
all-reduce with overlap off; pseudo-gradient, the wait for a late average,
checkpoint, consistency check with overlap on), ``gap_s`` the median of the
R − 2 gaps between phases, ``step_ms`` the mean inner step, ``allreduce_s``
the median of the all-reduce seconds of rounds 1..R from the commit lines,
``eval_loss`` after round R, ``resyncs`` and ``aborts`` counted in the log.
One row per mode holds the medians over nodes (``node`` = ``median``).

All nodes start at once: node 0 with an identity made up front, so the others
know its address to bootstrap through, and a 3 s head start (one that dials
it before it listens is started again). Node 0 still trains while the others
finish starting (several seconds on a busy machine). With overlap off it waits
for them at the end of phase 1; overlapped it runs one phase further and
waits at the end of phase 2, inside the window: its row shows that start-up
skew, and the median over nodes is the number to read; ``steady_utilization``
is the same ratio over phases 3..R, which leaves that skew out. A re-sync would throw
a phase's work away and shift the count of phases: the ``resyncs`` column
tells such a run apart.

Default settings (tiny model, 20 Mbit/s, 60 inner steps): the tiny model's
3.4 MB fp32 pseudo-gradient takes ~2.6 s to all-reduce among 4 hosts at
20 Mbit/s, a fifth to a third of a round on a shared 2-core machine, so the
wait with overlap off is plain to see; the small model (100 MB) would need
~16 s per all-reduce even at 100 Mbit/s and too few inner steps per minute.

The notes hold a per-round table for each mode (medians over nodes): the
phase's inner-step seconds, the gap after it, the round's all-reduce (median
and max), when the round committed (from the first phase's start), how far
apart the nodes committed, members, and whether all nodes committed the same
parameters. The node logs are kept in ``OUT/utilization-logs/MODE/``.

With ``--smoke`` (figures that mean nothing) the modes' swarms run at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.swarmbench_common import (_STAMP, RESYNC, SCRIPTS, aborted_attempts, commits, log_tail, median,
                                          node_argv, read_text, stamp_to_unix, stop_all)
from trainer.config import OVERLAP_MODES

TRAINED = re.compile(_STAMP + r"INFO gonka\.node: trained round=(\d+) steps=(\d+) seconds=([0-9.]+) loss=(\S+)", re.M)
SUMMARY_FIELDS = ["utilization", "steady_utilization", "train_seconds", "wall_seconds", "wait_seconds", "gap_s",
                  "step_ms", "allreduce_s", "eval_loss"]
COLUMNS = ["overlap", "node", *SUMMARY_FIELDS, "resyncs", "aborts"]
PORT = 31337
# Head start of node 0: the others dial it about this long after its p2pd listens (their
# start-up is the same as its own); one that dials too early is simply started again.
STAGGER = 3.0
LISTENING = re.compile(r"^listening on ", re.M)


def modes_arg(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in OVERLAP_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"must be distinct modes from {', '.join(OVERLAP_MODES)}, got {text!r}")
    return modes


def add_arguments(group) -> None:
    group.add_argument("--overlap", type=modes_arg, default=["off", "eager"],
                       help="overlap modes to compare, one swarm run each, in this order (default off,eager)")
    group.add_argument("--nodes", type=int,
                       help="testbed hosts, one node each (default 4; 2 with --smoke; min_peers = nodes)")
    group.add_argument("--rate", help="every host's link, both ways (default 20mbit: the tiny model's all-reduce "
                                      "takes ~2.6 s; 100mbit with --smoke)")
    group.add_argument("--rounds", type=int, help="outer rounds R (default 8; 4 with --quick)")
    group.add_argument("--inner-steps", type=int, help="inner steps per round (default 60; 30 with --quick, 3 with --smoke)")
    group.add_argument("--model", choices=["tiny", "small", "base"], default="tiny", help="model preset (default tiny)")
    group.add_argument("--run-timeout", type=float, help="seconds one mode's run may take (default 120 + 30 s per round)")
    group.add_argument("--prefix", default="gsj", help="testbed name prefix (default gsj)")


# ---- reading one node's log (pure) ---------------------------------------------------------

def phases(log: str) -> list[dict]:
    """Every `trained ...` line of a node log, in order: one phase of inner steps each."""
    out = []
    for stamp, ms, rnd, steps, seconds, loss in TRAINED.findall(log):
        end = stamp_to_unix(stamp, ms)
        out.append({"round": int(rnd), "steps": int(steps), "seconds": float(seconds), "end": end,
                    "start": end - float(seconds), "loss": float(loss)})
    return out


def node_summary(log: str, rounds: int) -> tuple[dict, list[dict], list[dict]]:
    """(row, phases 1..R, commits 1..R) of one node's log; ValueError if it lacks rounds."""
    ps, cs = phases(log), commits(log)
    if len(cs) < rounds or len(ps) < rounds:
        raise ValueError(f"committed {len(cs)} and trained {len(ps)} of {rounds} rounds")
    ps, cs = ps[:rounds], cs[:rounds]
    window = ps[1:]
    train = sum(p["seconds"] for p in window)
    wall = window[-1]["end"] - window[0]["start"]
    gaps = [b["start"] - a["end"] for a, b in zip(window, window[1:])]
    steady = window[1:]  # phases 3..R: overlapped, the start-up skew may land after phase 2
    steady_wall = steady[-1]["end"] - steady[0]["start"]
    row = {"utilization": train / wall if wall > 0 else None,
           "steady_utilization": sum(p["seconds"] for p in steady) / steady_wall if steady_wall > 0 else None,
           "train_seconds": train, "wall_seconds": wall,
           "wait_seconds": wall - train, "gap_s": median(gaps), "step_ms": 1000 * train / sum(p["steps"] for p in window),
           "allreduce_s": median(c["allreduce"] for c in cs), "eval_loss": final_eval_loss(cs),
           "resyncs": len(RESYNC.findall(log)), "aborts": aborted_attempts(log),
           # Phases whose logged round is not their place in the log (the label is the node's round + 1
           # when the phase ends, so overlapped it lags when the average arrives after the phase).
           "mislabeled": sum(p["round"] != k for k, p in enumerate(ps, 1))}
    return row, ps, cs


def final_eval_loss(cs: list[dict]) -> float | None:
    """The last evaluated loss in the commit lines (None if none: overlapped, evaluation runs after
    the commit line; run_mode then reads it from the status file)."""
    losses = [c["eval_loss"] for c in cs if c["eval_loss"] == c["eval_loss"]]  # x != x: NaN
    return losses[-1] if losses else None


def round_table(per_node: list[tuple[list[dict], list[dict]]]) -> list[dict]:
    """Per round, medians over nodes of (phases, commits) as node_summary returns them."""
    t0 = min(ps[0]["start"] for ps, _ in per_node)
    table = []
    for k in range(len(per_node[0][1])):
        cs = [node_cs[k] for _, node_cs in per_node]
        ts = [c["t"] for c in cs]
        gaps = [ps[k + 1]["start"] - ps[k]["end"] for ps, _ in per_node if k + 1 < len(ps)]
        table.append({"round": cs[0]["round"], "train_s": median(ps[k]["seconds"] for ps, _ in per_node),
                      "gap_after_s": median(gaps), "allreduce_s": median(c["allreduce"] for c in cs),
                      "allreduce_max_s": max(c["allreduce"] for c in cs), "commit_s": median(t - t0 for t in ts),
                      "spread_s": max(ts) - min(ts), "members": min(c["members"] for c in cs),
                      "identical": len({c["hash"] for c in cs}) == 1})
    return table


def round_notes(mode: str, table: list[dict]) -> list[str]:
    lines = [f"[{mode}] round  train_s  gap_after_s  allreduce_s  allreduce_max_s  commit_s  spread_s  members  identical"]
    for r in table:
        gap = "-" if r["gap_after_s"] is None else f"{r['gap_after_s']:.3f}"
        lines.append(f"{'':>{len(mode) + 2}} {r['round']:5d}  {r['train_s']:7.3f}  {gap:>11}  {r['allreduce_s']:11.3f}  "
                     f"{r['allreduce_max_s']:15.3f}  {r['commit_s']:8.2f}  {r['spread_s']:8.3f}  {r['members']:7d}  "
                     f"{'yes' if r['identical'] else 'NO':>9}")
    return lines


# ---- running one mode ---------------------------------------------------------------------

def run_mode(tb, mode: str, k: int, args, workdir: Path, logdir: Path,
             identity: tuple[Path, str]) -> tuple[list[dict], list[dict]]:
    """One swarm run with ``--overlap mode`` on testbed tb: (per-node rows, round table).

    identity = (key file, peer id) of node 0, so that every node can start at once with
    node 0's address as its bootstrap; waiting for node 0 to listen first would let it train
    alone for the others' whole start-up (tens of seconds on a busy 2-core machine)."""
    run_id = f"util{os.getpid()}{mode}"
    port = PORT + k  # a fresh port per mode: the previous run's sockets may linger
    bootstrap = f"/ip4/{tb.host_ip(0)}/tcp/{port}/p2p/{identity[1]}"
    timeout = args.run_timeout or 120 + 30 * args.rounds
    procs, logs, restarts = [], [], 0

    def start(i: int):
        argv = node_argv(ip=tb.host_ip(i), port=port, run_id=run_id, workdir=logs[i].parent, model=args.model,
                         inner_steps=args.inner_steps, min_peers=args.nodes, max_rounds=args.rounds,
                         bootstrap=bootstrap if i else None,
                         extra=["--overlap", mode, "--set", f"data.eval_every={args.rounds}",
                                *(["--identity", str(identity[0])] if i == 0 else [])])
        with open(logs[i], "wb") as f:
            return tb.run(i, argv, stdout=f, stderr=subprocess.STDOUT, cwd=logs[i].parent)

    try:
        for i in range(args.nodes):
            (workdir / mode / f"node{i}").mkdir(parents=True)
            logs.append(workdir / mode / f"node{i}" / "node.log")
            procs.append(start(i))
            if i == 0:
                time.sleep(STAGGER)
        # A node that dials node 0 before it listens exits at once: start it again.
        deadline = time.monotonic() + 120
        while not all(LISTENING.search(read_text(log)) for log in logs):
            for i in range(1, args.nodes):
                failed = procs[i].poll() not in (None, 0) and not LISTENING.search(read_text(logs[i]))
                if failed and restarts < 5 * args.nodes:
                    restarts += 1
                    procs[i] = start(i)
            if procs[0].poll() is not None or time.monotonic() > deadline:
                i = next((n for n, log in enumerate(logs) if not LISTENING.search(read_text(log))), 0)
                raise RuntimeError(f"[{mode}] node {i} never listened; log tail:\n{log_tail(logs[i])}")
            time.sleep(0.2)
        print(f"utilization [{mode}]: {args.nodes} nodes x {args.rounds} rounds of {args.inner_steps} inner steps "
              f"at {args.rate} ({restarts} early starts repeated) ...", file=sys.stderr, flush=True)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                i = next(n for n, p in enumerate(procs) if p.poll() is None)
                raise RuntimeError(f"[{mode}] node {i} still running after {timeout:.0f}s; log tail:\n{log_tail(logs[i])}")
            time.sleep(0.25)
    finally:
        stop_all(procs, grace=5)
        logdir.mkdir(parents=True, exist_ok=True)
        for i, log in enumerate(logs):
            shutil.copyfile(log, logdir / f"node{i}.log")
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"[{mode}] node {bad[0]} exited with {procs[bad[0]].returncode}; log tail:\n{log_tail(logs[bad[0]])}")
    rows, per_node = [], []
    for i, log in enumerate(logs):
        try:
            row, ps, cs = node_summary(read_text(log), args.rounds)
        except ValueError as e:
            raise RuntimeError(f"[{mode}] node {i}: {e}; log tail:\n{log_tail(log)}") from None
        if row["eval_loss"] is None:
            row["eval_loss"] = json.loads(read_text(log.parent / "status.json") or "{}").get("eval_loss")
        rows.append({"overlap": mode, "node": i, **row, "restarts": restarts})
        per_node.append((ps, cs))
    return rows, round_table(per_node)


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import netbed

    smoke = getattr(args, "smoke", False)
    args.nodes = args.nodes or (2 if smoke else 4)
    args.rate = args.rate or ("100mbit" if smoke else "20mbit")
    args.rounds = args.rounds or (4 if args.quick else 8)
    args.inner_steps = args.inner_steps or (3 if smoke else 30 if args.quick else 60)
    if args.nodes < 2 or args.rounds < 4 or args.inner_steps < 1:
        raise ValueError("--nodes must be >= 2, --rounds >= 4 (phases 2..R and 3..R need two each), --inner-steps >= 1")
    netbed.parse_rate(args.rate)
    logroot = args.out / "utilization-logs"
    workdir = Path(tempfile.mkdtemp(prefix="utilization-"))
    node_rows, summary, rounds, notes = [], {}, {}, []
    from p2p.identity import generate_identity, peer_id_from_key

    identities = []  # node 0's, one per mode: with --smoke the modes' swarms run at the same time
    for mode in args.overlap:
        key = generate_identity()
        (workdir / f"node0-{mode}.key").write_bytes(key)
        identities.append((workdir / f"node0-{mode}.key", peer_id_from_key(key)))
    try:
        with netbed.Testbed(args.nodes, rate=args.rate, prefix=f"{args.prefix}{os.getpid() % 100000}u") as tb:
            def one(k: int):
                mode = args.overlap[k]
                return run_mode(tb, mode, k, args, workdir, logroot / mode, identities[k])

            if smoke:  # side by side (ports and run ids of their own): the figures mean nothing, half the wall
                with ThreadPoolExecutor(len(args.overlap)) as pool:
                    results = list(pool.map(one, range(len(args.overlap))))
            else:
                results = [one(k) for k in range(len(args.overlap))]
            for mode, (rows, table) in zip(args.overlap, results):
                node_rows += rows
                summary[mode] = {f: median(r[f] for r in rows) for f in SUMMARY_FIELDS}
                summary[mode].update(resyncs=sum(r["resyncs"] for r in rows), aborts=sum(r["aborts"] for r in rows),
                                     mislabeled=sum(r["mislabeled"] for r in rows), restarts=rows[0]["restarts"])
                rounds[mode] = table
                notes += round_notes(mode, table)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    medians = [{"overlap": m, "node": "median", **s} for m, s in summary.items()]
    head = [f"{m}: utilization {s['utilization']:.1%} over phases 2..{args.rounds}, {s['steady_utilization']:.1%} over "
            f"3..{args.rounds} (train {s['train_seconds']:.1f}s "
            f"of {s['wall_seconds']:.1f}s wall, gap {s['gap_s']:.3f}s, all-reduce {s['allreduce_s']:.3f}s); "
            f"{s['resyncs']} resyncs, {s['aborts']} aborted attempts in all logs" for m, s in summary.items()]
    head += [f"{m}: {s['mislabeled']} 'trained' lines carry a round other than their place in the log (the node "
             f"logs its round + 1 at the end of a phase; overlapped, that lags while the average is still out)"
             for m, s in summary.items() if s["mislabeled"]]
    return {"rows": medians + node_rows, "columns": COLUMNS, "notes": head + notes,
            "summary": summary, "rounds": rounds,
            "definition": f"utilization = sum of inner-step seconds of phases 2..{args.rounds} / (end of phase "
                          f"{args.rounds} - start of phase 2), from each node's 'trained' log lines; medians over nodes",
            "config": {"overlap": args.overlap, "nodes": args.nodes, "rate": args.rate, "rounds": args.rounds,
                       "inner_steps": args.inner_steps, "model": args.model, "eval_every": args.rounds},
            "load_average": os.getloadavg()}
