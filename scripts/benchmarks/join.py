"""Benchmark ``join``: how fast a new peer downloads the training state from a live swarm.

A ``netbed.Testbed`` of ``--donors`` + 1 hosts: hosts 0..N-1 run real
`gonka-node start` donors (``--model``, small by default, tiny with --quick;
``--min-peers N``; ``--inner-steps`` long enough that a donor spends most of
a round training), every donor link at ``--rate``; the last host is the
joiner, its link at ``--joiner-rate`` (default ``--rate``). Once every donor
committed ``--warmup-rounds`` rounds (so the swarm's state differs from a
fresh node's), a fresh joiner starts (new directory, new peer id,
``--max-rounds 1``: it downloads the swarm's state in ``join()``, then stops
by itself), ``--joins`` times in a row; medians are reported.

Per join: ``seconds`` is the joiner's own measurement (its ``downloaded round
R state (X MB) from D donors in S s`` log line: meta requests, parallel chunk
downloads from every donor and verification), ``state_bytes`` what it
fetched (fp32 parameters + outer momentum), ``bound_seconds`` = state_bytes
* 8 / joiner link rate (TCP over the testbed carries ~95.6% of nominal, so a
perfect download reaches a ratio of ~1.05), ``start_to_synced_s`` the whole
join from process start to the ``resynced`` line (start-up, DHT bootstrap,
failed attempts included), ``failed_attempts`` downloads the joiner retried,
``caught_up`` the rounds the swarm committed during the download that the
joiner then took from their averages (p2p/averagelog.py) and
``donor_rounds_during`` the donor commits while it downloaded. With
``--inner-steps`` short enough, every download spans donor rounds.

Donor impact: each donor round (commit to commit) and each donor all-reduce
is classed ``during`` if its time span overlaps any download, ``before`` if
it ended before the first join; the summary compares their medians.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.options import add_wan_arguments, wan_settings
from benchmarks.swarmbench_common import (SCRIPTS, commits, downloads, heartbeat_for, listening_address, log_tail,
                                          median, node_argv, read_text, state_bytes, stamp_to_unix)

COLUMNS = ["join", "model", "donors", "round", "state_bytes", "seconds", "bound_seconds", "ratio_to_bound",
           "start_to_synced_s", "failed_attempts", "caught_up", "donor_rounds_during", "average_mb", "average_s"]
PORT = 31337
RESYNCED = re.compile(r"^(\S+ \S+),(\d+) INFO gonka\.node: resynced round=(\d+)", re.M)
CAUGHT_UP = re.compile(r"caught up (\d+) rounds from their averages")
AVERAGE = re.compile(r"downloaded round \d+ average \(([\d.]+) MB, \w+\) from \d+ donors in ([\d.]+)s")


def add_arguments(group) -> None:
    group.add_argument("--donors", type=int,
                       help="donor hosts running gonka-node (default 3; 2 with --smoke; min_peers = donors)")
    group.add_argument("--rate", default="100mbit", help="every donor's link, both ways (default 100mbit)")
    group.add_argument("--joiner-rate", help="the joiner's link, the bound's basis (default: --rate)")
    group.add_argument("--model", choices=["tiny", "small", "base"], help="model preset (default small; tiny with --quick)")
    group.add_argument("--inner-steps", type=int, help="donors' inner steps per round (default 12 for small, 100 for "
                                                       "tiny, 40 with --quick, 10 with --smoke)")
    group.add_argument("--codec", default="fp32", help="swarm.codec of every node (default fp32)")
    group.add_argument("--joins", type=int, help="joins, each with a fresh joiner (default 3; 2 with --quick, 1 with --smoke)")
    group.add_argument("--warmup-rounds", type=int, help="rounds every donor commits before the first join (default 2; 1 with --quick)")
    group.add_argument("--join-timeout", type=float, default=180.0, help="seconds one joiner may take (default 180)")
    group.add_argument("--prefix", default="gsj", help="testbed name prefix (default gsj)")
    add_wan_arguments(group)  # any two hosts --rtt apart (docs/testbed.md)


def wait_for_commits(logs: list[Path], procs, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = [len(commits(read_text(p))) >= count for p in logs]
        if all(done):
            return
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise RuntimeError(f"donor {i} exited with {p.returncode}; log tail:\n{log_tail(logs[i])}")
        if time.monotonic() > deadline:
            i = done.index(False)
            raise RuntimeError(f"donor {i} did not commit {count} round(s) in {timeout:.0f}s; log tail:\n{log_tail(logs[i])}")
        time.sleep(0.25)


def one_join(tb, j: int, args, workdir: Path, bootstrap: str, rate_bps: int, size: int) -> dict:
    host = args.donors
    jdir = workdir / f"joiner{j}"
    jdir.mkdir()
    log = jdir / "node.log"
    argv = node_argv(ip=tb.host_ip(host), port=PORT + 1 + j, run_id=args.run_id, workdir=jdir, model=args.model,
                     inner_steps=args.inner_steps, min_peers=args.donors, max_rounds=1, bootstrap=bootstrap,
                     heartbeat=heartbeat_for(args.rtt), extra=["--set", f"swarm.codec={args.codec}"])
    started = time.time()
    with open(log, "wb") as f:
        proc = tb.run(host, argv, stdout=f, stderr=subprocess.STDOUT, cwd=jdir)
    try:
        proc.wait(args.join_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"joiner {j} still running after {args.join_timeout:.0f}s; log tail:\n{log_tail(log)}")
    text = read_text(log)
    got = downloads(text)
    synced = RESYNCED.findall(text)
    if not got or not synced:
        raise RuntimeError(f"joiner {j} exited ({proc.returncode}) without downloading the state; log tail:\n{log_tail(log)}")
    d = got[-1]
    bound = size * 8 / rate_bps
    return {"join": j, "model": args.model, "donors": d["donors"], "round": d["round"], "state_bytes": size,
            "logged_mb": d["mb"], "seconds": d["seconds"], "bound_seconds": bound, "ratio_to_bound": d["seconds"] / bound,
            "start_to_synced_s": stamp_to_unix(*synced[-1][:2]) - started,
            "failed_attempts": text.count("state download failed"),
            "caught_up": sum(int(n) for n in CAUGHT_UP.findall(text)),
            # each round's average fetched while catching up: size and seconds (medians)
            "average_mb": median(float(mb) for mb, _ in AVERAGE.findall(text)),
            "average_s": median(float(s) for _, s in AVERAGE.findall(text)),
            "failures": re.findall(r"state download failed: (.*)", text)[:5],
            "window": [d["t"] - d["seconds"], d["t"]]}


def donor_impact(logs: list[Path], windows: list[list[float]]) -> dict:
    """Donor all-reduce and round times before the first join vs overlapping a download."""
    first = min(w[0] for w in windows)

    def overlaps(a: float, b: float) -> bool:
        return any(a < w1 and b > w0 for w0, w1 in windows)

    out = {"allreduce": {"before": [], "during": [], "after": []}, "round": {"before": [], "during": [], "after": []}}
    for path in logs:
        cs = commits(read_text(path))
        for k, c in enumerate(cs):
            a, b = c["t"] - c["allreduce"], c["t"]
            out["allreduce"]["during" if overlaps(a, b) else "before" if b < first else "after"].append(c["allreduce"])
            if k:
                a = cs[k - 1]["t"]
                out["round"]["during" if overlaps(a, b) else "before" if b < first else "after"].append(b - a)
    return out


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import netbed

    smoke = getattr(args, "smoke", False)
    args.donors = args.donors or (2 if smoke else 3)
    args.model = args.model or ("tiny" if args.quick else "small")
    args.inner_steps = args.inner_steps or (10 if smoke else (40 if args.quick else 100) if args.model == "tiny" else 12)
    args.joins = args.joins or (1 if smoke else 2 if args.quick else 3)
    args.warmup_rounds = args.warmup_rounds or (1 if args.quick else 2)
    # A joiner fewer rounds behind than the state is worth in averages takes them from genesis
    # instead of downloading the state (node/catchup.py): this benchmark measures downloads.
    from p2p.codecs import get_codec

    per_value = get_codec(args.codec).wire_bytes(1 << 20) / (1 << 20)
    args.warmup_rounds = max(args.warmup_rounds, math.ceil(8 / per_value))
    if args.donors < 1 or args.joins < 1 or args.inner_steps < 1:
        raise ValueError("--donors, --joins and --inner-steps must be >= 1")
    netbed.parse_rate(args.rate)  # a bad --rate fails here, before any host is made
    joiner_rate = args.joiner_rate or args.rate
    joiner_bps = netbed.parse_rate(joiner_rate)
    size = state_bytes(args.model)
    args.run_id = f"join{os.getpid()}"
    workdir = Path(tempfile.mkdtemp(prefix="join-"))
    rows, notes = [], []
    try:
        with netbed.Testbed(args.donors + 1, rates=[args.rate] * args.donors + [joiner_rate],
                            prefix=f"{args.prefix}{os.getpid() % 100000}j", **wan_settings(args)) as tb:
            procs, logs = [], []
            bootstrap = None
            for i in range(args.donors):  # donor 0 first: the others bootstrap from it
                ddir = workdir / f"donor{i}"
                ddir.mkdir()
                logs.append(ddir / "node.log")
                argv = node_argv(ip=tb.host_ip(i), port=PORT, run_id=args.run_id, workdir=ddir, model=args.model,
                                 inner_steps=args.inner_steps, min_peers=args.donors, bootstrap=bootstrap,
                                 heartbeat=heartbeat_for(args.rtt), extra=["--set", f"swarm.codec={args.codec}"])
                with open(logs[i], "wb") as f:
                    procs.append(tb.run(i, argv, stdout=f, stderr=subprocess.STDOUT, cwd=ddir))
                if i == 0:
                    bootstrap = listening_address(logs[0], procs[0], 90)
                    if bootstrap is None:
                        raise RuntimeError(f"donor 0 never listened; log tail:\n{log_tail(logs[0])}")
            print(f"join: {args.donors} donors ({args.model}) up; waiting for {args.warmup_rounds} round(s) ...",
                  file=sys.stderr, flush=True)
            wait_for_commits(logs, procs, args.warmup_rounds, 120 + 60 * args.warmup_rounds)
            for j in range(args.joins):
                row = one_join(tb, j, args, workdir, bootstrap, joiner_bps, size)
                w0, w1 = row["window"]
                row["donor_rounds_during"] = sum(w0 < c["t"] <= w1 for c in commits(read_text(logs[0])))
                print(f"join: joiner {j}: {row['seconds']:.2f}s (bound {row['bound_seconds']:.2f}s) from "
                      f"{row['donors']} donors", file=sys.stderr, flush=True)
                rows.append(row)
            # One more donor round, so a round overlapping the last download has finished and counts.
            if not args.quick:
                n_before = min(len(commits(read_text(p))) for p in logs)
                try:
                    wait_for_commits(logs, procs, n_before + 1, 120)
                except RuntimeError as e:
                    notes.append(f"no donor round after the last join: {str(e).splitlines()[0]}")
            impact = donor_impact(logs, [r["window"] for r in rows])
            donor_logs = {f"donor{i}": [dict(c) for c in commits(read_text(p))] for i, p in enumerate(logs)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    summary = {
        "model": args.model, "donors": args.donors, "state_bytes": size, "rtt_ms": args.rtt,
        "seconds": median(r["seconds"] for r in rows), "bound_seconds": size * 8 / joiner_bps,
        "ratio_to_bound": median(r["ratio_to_bound"] for r in rows),
        "start_to_synced_s": median(r["start_to_synced_s"] for r in rows),
        "caught_up": median(r["caught_up"] for r in rows),
        "donor_rounds_during": median(r["donor_rounds_during"] for r in rows),
        "donor_allreduce_before_s": median(impact["allreduce"]["before"]),
        "donor_allreduce_during_s": median(impact["allreduce"]["during"]),
        "donor_round_before_s": median(impact["round"]["before"]),
        "donor_round_during_s": median(impact["round"]["during"]),
        "samples": {k: {c: len(v) for c, v in d.items()} for k, d in impact.items()},
    }
    for r in rows:
        notes += [f"joiner {r['join']}: download failed: {why}" for why in r.pop("failures")]
    notes.append(f"median: {summary['seconds']:.2f}s vs bound {summary['bound_seconds']:.2f}s "
                 f"(ratio {summary['ratio_to_bound']:.2f}); whole join {summary['start_to_synced_s']:.1f}s")
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}s"  # noqa: E731
    notes.append(f"donor all-reduce before joins {fmt(summary['donor_allreduce_before_s'])} "
                 f"(n={summary['samples']['allreduce']['before']}), during downloads "
                 f"{fmt(summary['donor_allreduce_during_s'])} (n={summary['samples']['allreduce']['during']}); "
                 f"donor round before {fmt(summary['donor_round_before_s'])}, during {fmt(summary['donor_round_during_s'])}")
    return {"rows": rows, "columns": COLUMNS, "notes": notes, "summary": summary,
            "config": {"donors": args.donors, "codec": args.codec, "rate": args.rate, "joiner_rate": joiner_rate, "model": args.model,
                       "rtt_ms": args.rtt, "loss_percent": args.loss, "tcp_buffers": args.tcp_buffers,
                       "inner_steps": args.inner_steps, "joins": args.joins, "warmup_rounds": args.warmup_rounds},
            "donor_commits": donor_logs, "impact": impact, "load_average": os.getloadavg()}
