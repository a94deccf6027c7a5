"""Benchmark ``killed``: what a member killed in the middle of a round costs the others, by RTT.

A ``netbed.Testbed`` of ``--nodes`` hosts, any two ``--rtt`` apart, each
running `gonka-node start` (``--model``, ``--min-peers`` one less than the
nodes, so the rest can go on). The last node SIGKILLs itself at ``--phase``
of round ``--kill-round`` (``p2p/faults.py``: ``reduce``, its pieces sent and
no average back yet). Once every survivor committed ``--after`` rounds
without it, the survivors' logs say:

- ``normal_s``: a round's time (commit to commit) before the kill, median;
- ``killed_round_s``: the round the member died in, from the commit before
  it to the first commit without it; ``extra_s`` = killed − normal, also in
  round trips (``extra_rtts``);
- ``aborted``: attempts the survivors aborted on the way (slowest survivor);
- ``members``: members of that first commit (the nodes minus one).

The killed process's sockets close with it, so its peers hear of it within
a round trip. ``--how drop`` measures a host that drops off the network
without closing anything instead: the last node SIGSTOPs itself at the phase
(``/stop``, p2p/faults.py) and the benchmark takes its link down at once
(``ip link set eth0 down`` in its namespace: its p2pd goes silent too), so its
peers learn of it only from their deadlines (p2p/deadline.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.options import add_wan_arguments, positive_int, wan_settings
from benchmarks.swarmbench_common import (SCRIPTS, aborted_attempts, commits, heartbeat_for, listening_address,
                                          log_tail, median, node_argv, read_text)

PORT = 31337
COLUMNS = ["how", "rtt_ms", "nodes", "normal_s", "killed_round_s", "extra_s", "extra_rtts", "aborted", "members"]


def add_arguments(group) -> None:
    group.add_argument("--nodes", type=positive_int, help="testbed hosts, one node each (default 4; 3 with --smoke)")
    group.add_argument("--rate", default="100mbit", help="every host's link, both ways (default 100mbit)")
    group.add_argument("--model", choices=["tiny", "small"], default="tiny", help="model preset (default tiny)")
    group.add_argument("--inner-steps", type=positive_int, default=20,
                       help="inner steps per round (default 20: the rounds must outlast a late node's state download, "
                            "or it never joins a full group before the kill round)")
    group.add_argument("--phase", choices=["grouped", "reduce", "gather", "commit"], default="reduce",
                       help="where the last node dies (p2p/faults.py; default reduce)")
    group.add_argument("--how", choices=["kill", "drop"], default="kill",
                       help="kill: SIGKILL (its connections close); drop: it hangs and its link goes down "
                            "(nothing closes) (default kill)")
    group.add_argument("--node-set", action="append", default=[], metavar="KEY=VALUE",
                       help="a setting of every node (gonka-node --set), e.g. swarm.round_timeout=900; repeatable")
    group.add_argument("--kill-round", type=positive_int, default=4, help="the round it dies in (default 4)")
    group.add_argument("--after", type=positive_int, help="rounds the survivors commit without it (default 2; 1 "
                                                          "with --quick)")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds the whole run may take (default 600)")
    group.add_argument("--prefix", default="gsk", help="testbed name prefix (default gsk)")
    add_wan_arguments(group)


def after_the_kill(seen: list[dict], nodes: int) -> tuple[int, int] | None:
    """(first commit with every node, first commit after it without one), indices into ``seen``
    (a node that starts late misses the first rounds); None before both happened."""
    full = next((k for k, c in enumerate(seen) if c["members"] == nodes), None)
    if full is None:
        return None
    first = next((k for k in range(full + 1, len(seen)) if seen[k]["members"] < nodes), None)
    return None if first is None else (full, first)


def survivors_view(logs: list[Path], nodes: int) -> dict:
    """The figures above, from the survivors' commit lines."""
    normal, killed, members = [], [], []
    for path in logs:
        seen = commits(read_text(path))
        found = after_the_kill(seen, nodes)
        if found is None:
            raise RuntimeError(f"{path.parent.name}: no commit without the killed node after one with it")
        full, first = found
        full = [c["t"] for c in seen[full:first]]
        normal += [b - a for a, b in zip(full, full[1:])]
        killed.append(seen[first]["t"] - seen[first - 1]["t"])
        members.append(seen[first]["members"])
    return {"normal_s": median(normal), "killed_round_s": median(killed), "members": min(members),
            "aborted": max(aborted_attempts(read_text(p)) for p in logs)}


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import netbed

    smoke = getattr(args, "smoke", False)
    args.nodes = args.nodes or (3 if smoke else 4)
    args.after = args.after or (1 if args.quick else 2)
    if args.nodes < 3:
        raise ValueError("--nodes must be at least 3 (two survivors make a round)")
    if args.kill_round < 2:
        raise ValueError("--kill-round must be at least 2 (a normal round comes first)")
    netbed.parse_rate(args.rate)
    run_id = f"killed{os.getpid()}"
    workdir = Path(tempfile.mkdtemp(prefix="killed-"))
    survivors = args.nodes - 1
    try:
        with netbed.Testbed(args.nodes, rate=args.rate, prefix=f"{args.prefix}{os.getpid() % 100000}",
                            **wan_settings(args)) as tb:
            procs, logs, bootstrap = [], [], None
            for i in range(args.nodes):
                ndir = workdir / f"node{i}"
                ndir.mkdir()
                logs.append(ndir / "node.log")
                env = dict(os.environ)
                if i == survivors:
                    env["GONKA_TEST_FAULT"] = f"{args.phase}@{args.kill_round}:{args.nodes}" + \
                        ("/stop" if args.how == "drop" else "")
                argv = node_argv(ip=tb.host_ip(i), port=PORT, run_id=run_id, workdir=ndir, model=args.model,
                                 inner_steps=args.inner_steps, min_peers=survivors, bootstrap=bootstrap,
                                 heartbeat=heartbeat_for(args.rtt),
                                 extra=[a for kv in args.node_set for a in ("--set", kv)])
                with open(logs[i], "wb") as f:
                    procs.append(tb.run(i, argv, stdout=f, stderr=subprocess.STDOUT, cwd=ndir, env=env))
                if i == 0:
                    bootstrap = listening_address(logs[0], procs[0], 90)
                    if bootstrap is None:
                        raise RuntimeError(f"node 0 never listened; log tail:\n{log_tail(logs[0])}")
            deadline = time.monotonic() + args.timeout
            dropped = False
            while True:
                if args.how == "drop" and not dropped and "fault injection: SIGSTOP at" in read_text(logs[-1]):
                    netbed.cmd("ip", "-n", tb.namespace(survivors), "link", "set", "eth0", "down")
                    dropped = True
                done = []
                for path in logs[:survivors]:
                    seen = commits(read_text(path))
                    found = after_the_kill(seen, args.nodes)
                    done.append(found is not None and len(seen) - found[1] >= args.after)
                if all(done):
                    break
                for i, p in enumerate(procs[:survivors]):
                    if p.poll() is not None:
                        raise RuntimeError(f"node {i} exited with {p.returncode}; log tail:\n{log_tail(logs[i])}")
                if time.monotonic() > deadline:
                    i = done.index(False)
                    raise RuntimeError(f"node {i} did not commit {args.after} round(s) without the killed node in "
                                       f"{args.timeout:.0f}s; log tail:\n{log_tail(logs[i])}")
                time.sleep(0.1)
            if args.how == "kill" and procs[survivors].poll() is None:
                raise RuntimeError("the node meant to die is still running: the fault never fired")
            if args.how == "drop" and not dropped:
                raise RuntimeError("the node meant to drop off never stopped: the fault never fired")
            view = survivors_view(logs[:survivors], args.nodes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    extra = view["killed_round_s"] - view["normal_s"]
    row = {"how": args.how, "rtt_ms": args.rtt, "nodes": args.nodes, **view, "extra_s": extra,
           "extra_rtts": extra / (args.rtt / 1000) if args.rtt else None}
    notes = [f"a member {'killed' if args.how == 'kill' else 'dropped off'} at {args.phase} cost the survivors {extra:.2f}s over a {view['normal_s']:.2f}s round "
             f"({view['aborted']} aborted attempt(s)); next commit had {view['members']} members"]
    return {"rows": [row], "columns": COLUMNS, "notes": notes,
            "config": {"nodes": args.nodes, "rate": args.rate, "model": args.model, "inner_steps": args.inner_steps,
                       "phase": args.phase, "how": args.how, "node_set": args.node_set, "kill_round": args.kill_round, "after": args.after, "rtt_ms": args.rtt,
                       "loss_percent": args.loss, "tcp_buffers": args.tcp_buffers},
            "load_average": os.getloadavg()}
