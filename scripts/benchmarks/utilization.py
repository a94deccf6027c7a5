"""Benchmark ``utilization``: the share of wall time a node spends in inner steps during a real run.

``--nodes`` real `gonka-node start` processes (tiny model, ``--min-peers``
= nodes, ``--max-rounds`` = ``--rounds``) on a ``netbed.Testbed`` at
``--rate``; a scraper inside each host's namespace polls the node's metrics
endpoint (``swarmbench_scrape.py``). The node loop is not overlapped yet:
averaging blocks the next round's inner steps, so utilization sits well
below 1 — this is the baseline issue 5 improves on.

Per node:

- ``train_seconds``: time in inner steps. ``gonka_node_inner_step_seconds``
  gets one observation per round (the round's *mean* step time), so the
  total is ``_sum * inner_steps_total / _count`` (exact when every round
  has the same number of steps, as here);
- ``wall_seconds``: from the node's first inner step to its last commit. The
  start of the first inner step is not logged, so it is estimated as the
  first commit minus round 1's inner steps, gather wait and all-reduce
  (round 1's apply + evaluation is left in, ~tens of ms);
- ``wait_seconds`` = wall − train; ``utilization`` = train / wall;
- ``steady_utilization``: the same from the first to the last commit (rounds
  2..R), leaving out the start-up skew that round 1's gather absorbs;
- ``gather_wait_s`` / ``allreduce_s``: medians per round (rounds 2..R for
  the gather wait, from the metrics; all rounds for the all-reduce, from the
  log).

The notes hold the per-round table: commit time (median over nodes, from the
swarm's first commit), spread of the commits, all-reduce seconds (median and
max over nodes), members.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.swarmbench_common import (SCRIPTS, commits, listening_address, log_tail, median, node_argv, read_text,
                                          stop_all)

SCRAPER = Path(__file__).resolve().parent / "swarmbench_scrape.py"
COLUMNS = ["node", "rounds", "inner_steps", "step_ms", "train_seconds", "wall_seconds", "wait_seconds", "utilization",
           "steady_utilization", "gather_wait_s", "allreduce_s"]
PORT, METRICS_PORT = 31337, 9400
SCRAPE_INTERVAL = 0.2


def add_arguments(group) -> None:
    group.add_argument("--nodes", type=int, default=4, help="testbed hosts, one node each (default 4; min_peers = nodes)")
    group.add_argument("--rate", default="100mbit", help="every host's link, both ways (default 100mbit)")
    group.add_argument("--rounds", type=int, help="outer rounds (default 8; 4 with --quick)")
    group.add_argument("--inner-steps", type=int, help="inner steps per round (default 100; 50 with --quick)")
    group.add_argument("--model", choices=["tiny", "small", "base"], default="tiny", help="model preset (default tiny)")
    group.add_argument("--run-timeout", type=float, help="seconds the run may take (default 120 + 30 s per round)")
    group.add_argument("--prefix", default="gsj", help="testbed name prefix (default gsj)")


def load_series(path: Path) -> list[dict]:
    out = []
    for line in read_text(path).splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def node_row(i: int, log: str, series: list[dict], args) -> tuple[dict, list[dict]]:
    cs = commits(log)
    if len(cs) < args.rounds:
        raise RuntimeError(f"node {i} committed {len(cs)} of {args.rounds} rounds")
    final = max((s["m"] for s in series), key=lambda m: m.get("gonka_node_inner_steps_total", 0), default={})
    steps = final.get("gonka_node_inner_steps_total", 0)
    count = final.get("gonka_node_inner_step_seconds_count", 0)
    if not count or steps < args.rounds * args.inner_steps:
        raise RuntimeError(f"node {i}: the scraper never saw all inner steps (saw {steps:.0f}, {count:.0f} rounds)")
    train = final["gonka_node_inner_step_seconds_sum"] * steps / count
    # Round 1 as the metrics saw it: the first scrape with one round of inner steps recorded.
    first = next((s["m"] for s in series if s["m"].get("gonka_node_inner_step_seconds_count") == 1), None)
    first_g = next((s["m"] for s in series if s["m"].get("gonka_node_gather_wait_seconds_count") == 1), None)
    if first is None or first_g is None:
        raise RuntimeError(f"node {i}: the scraper missed round 1")
    train_1 = first["gonka_node_inner_step_seconds_sum"] * first["gonka_node_inner_steps_total"]
    gather_1 = first_g["gonka_node_gather_wait_seconds_sum"]
    c1, cr = cs[0], cs[args.rounds - 1]
    t_first_step = c1["t"] - c1["allreduce"] - gather_1 - train_1
    wall = cr["t"] - t_first_step
    steady_wall = cr["t"] - c1["t"]
    g_count = final.get("gonka_node_gather_wait_seconds_count", 0)
    gather_rest = ((final["gonka_node_gather_wait_seconds_sum"] - gather_1) / (g_count - 1)) if g_count > 1 else None
    row = {"node": i, "rounds": len(cs), "inner_steps": int(steps), "step_ms": 1000 * train / steps,
           "train_seconds": train, "wall_seconds": wall, "wait_seconds": wall - train, "utilization": train / wall,
           "steady_utilization": (train - train_1) / steady_wall if steady_wall > 0 else None,
           "gather_wait_s": gather_rest, "allreduce_s": median(c["allreduce"] for c in cs[: args.rounds]),
           "round1_gather_s": gather_1, "round1_train_s": train_1}
    return row, cs[: args.rounds]


def round_table(per_node: list[list[dict]]) -> list[dict]:
    t0 = min(cs[0]["t"] for cs in per_node)
    table = []
    for k in range(len(per_node[0])):
        cs = [node[k] for node in per_node]
        ts = [c["t"] for c in cs]
        table.append({"round": cs[0]["round"], "commit_s": median(t - t0 for t in ts), "spread_s": max(ts) - min(ts),
                      "allreduce_s": median(c["allreduce"] for c in cs), "allreduce_max_s": max(c["allreduce"] for c in cs),
                      "members": min(c["members"] for c in cs), "identical": len({c["hash"] for c in cs}) == 1,
                      "eval_loss": median(c["eval_loss"] for c in cs)})
    return table


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import netbed

    args.rounds = args.rounds or (4 if args.quick else 8)
    args.inner_steps = args.inner_steps or (50 if args.quick else 100)
    if args.nodes < 2 or args.rounds < 2 or args.inner_steps < 1:
        raise ValueError("--nodes and --rounds must be >= 2, --inner-steps >= 1")
    netbed.parse_rate(args.rate)
    timeout = args.run_timeout or 120 + 30 * args.rounds
    run_id = f"util{os.getpid()}"
    workdir = Path(tempfile.mkdtemp(prefix="utilization-"))
    try:
        with netbed.Testbed(args.nodes, rate=args.rate, prefix=f"{args.prefix}{os.getpid() % 100000}u") as tb:
            procs, logs, scrapers = [], [], []
            bootstrap = None
            for i in range(args.nodes):
                ndir = workdir / f"node{i}"
                ndir.mkdir()
                logs.append(ndir / "node.log")
                argv = node_argv(ip=tb.host_ip(i), port=PORT, run_id=run_id, workdir=ndir, model=args.model,
                                 inner_steps=args.inner_steps, min_peers=args.nodes, max_rounds=args.rounds,
                                 bootstrap=bootstrap, metrics_port=METRICS_PORT)
                with open(logs[i], "wb") as f:
                    procs.append(tb.run(i, argv, stdout=f, stderr=subprocess.STDOUT, cwd=ndir))
                scrapers.append(tb.run(i, [sys.executable, SCRAPER, f"http://{tb.host_ip(i)}:{METRICS_PORT}/metrics",
                                           ndir / "metrics.jsonl", SCRAPE_INTERVAL, timeout + 30],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                if i == 0:
                    bootstrap = listening_address(logs[0], procs[0], 90)
                    if bootstrap is None:
                        raise RuntimeError(f"node 0 never listened; log tail:\n{log_tail(logs[0])}")
            print(f"utilization: {args.nodes} nodes x {args.rounds} rounds of {args.inner_steps} inner steps "
                  f"at {args.rate} ...", file=sys.stderr, flush=True)
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    i = next(k for k, p in enumerate(procs) if p.poll() is None)
                    raise RuntimeError(f"node {i} still running after {timeout:.0f}s; log tail:\n{log_tail(logs[i])}")
                time.sleep(0.25)
            stop_all(scrapers, grace=5)
            bad = [i for i, p in enumerate(procs) if p.returncode != 0]
            if bad:
                raise RuntimeError(f"node {bad[0]} exited with {procs[bad[0]].returncode}; log tail:\n{log_tail(logs[bad[0]])}")
            rows, per_node = [], []
            for i in range(args.nodes):
                row, cs = node_row(i, read_text(logs[i]), load_series(workdir / f"node{i}" / "metrics.jsonl"), args)
                rows.append(row)
                per_node.append(cs)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rounds = round_table(per_node)
    summary = {k: median(r[k] for r in rows) for k in ("step_ms", "train_seconds", "wall_seconds", "wait_seconds",
                                                      "utilization", "steady_utilization", "gather_wait_s", "allreduce_s")}
    notes = [f"median utilization {summary['utilization']:.1%} (steady state, rounds 2..{args.rounds}: "
             f"{summary['steady_utilization']:.1%}); train {summary['train_seconds']:.1f}s of {summary['wall_seconds']:.1f}s wall",
             "round  commit_s  spread_s  allreduce_s  allreduce_max_s  members  identical  eval_loss"]
    for r in rounds:
        notes.append(f"{r['round']:5d}  {r['commit_s']:8.2f}  {r['spread_s']:8.3f}  {r['allreduce_s']:11.3f}  "
                     f"{r['allreduce_max_s']:15.3f}  {r['members']:7d}  {'yes' if r['identical'] else 'NO':>9}  "
                     f"{r['eval_loss']:9.4f}")
    return {"rows": rows, "columns": COLUMNS, "notes": notes, "summary": summary, "rounds": rounds,
            "config": {"nodes": args.nodes, "rate": args.rate, "rounds": args.rounds, "inner_steps": args.inner_steps,
                       "model": args.model, "scrape_interval": SCRAPE_INTERVAL},
            "load_average": os.getloadavg()}
