"""Benchmark ``memory``: host memory per parameter of a training host, while it trains and
while it averages, for 1 and 2 ranks.

Two hosts on loopback (real `gonka-node start`, ``--device cpu``, ``--nproc-per-node R``,
``--min-peers 2``, a lossy codec with error feedback: int8 by default) train ``--rounds``
rounds. Every 50 ms the resident memory (``VmRSS``) of every process of the first host is
summed: the launcher and its ranks (R > 1) or the node (R = 1), and ``p2pd``. Each sample is
classed *train* (inside an inner-step phase, from the node's ``trained round=... seconds=...``
lines) or *round* (the rest of the round: pseudo-gradient, all-reduce, outer step, snapshot,
checkpoint-free). The first round is a warm-up and is left out.

Per parameter: the host's peak RSS in each phase, for two model sizes, as the slope
``(peak(big) - peak(small)) / (params(big) - params(small))``, which leaves out what does not
grow with the model (interpreter, libraries, p2pd). ``minimum`` is what the design needs on a
CPU host, where the inner loop's model is in host RAM too: parameters, gradients and AdamW's
two moments (16 bytes), plus the outer state (θ 4, momentum 4, residual 4) and at most 2 bytes
of round buffers: 30. On a GPU host the first 16 are on the GPUs and the goal is 14.

That CPU host's figure mostly shows what the allocator keeps of the inner loop's temporaries
(the round's buffers reuse memory they freed). So the outer state is also measured alone
(``--outer-params``): two processes on loopback hold θ and the momentum and run real rounds and
outer steps with no model (``outer_memory_peer.py``), as a GPU host's RAM sees them; its slope
is the GPU host's bytes per parameter, against the goal of 14.

With ``--smoke`` (toy sizes, figures that mean nothing) the two sizes of each measurement run
side by side, each pair of hosts on a run id of its own, and the hosts train on one sequence of
16 tokens per inner step: the tests run the smoke every time, for the code path only.
"""

from __future__ import annotations

import json
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

from benchmarks.swarmbench_common import (NODE_BIN, listening_address, log_tail, process_tree, rss_bytes, state_numel,
                                          stop_all)

COLUMNS = ["model", "ranks", "params", "train_peak_mb", "round_peak_mb", "round_anon_peak_mb"]
TRAINED = re.compile(r"^(\S+ \S+),(\d{3}) INFO gonka\.node: trained round=(\d+) steps=\d+ seconds=([0-9.]+)", re.M)
MINIMUM_CPU = 30  # bytes per parameter: see the module docstring


def add_arguments(group) -> None:
    group.add_argument("--models", default="tiny,small", help="two presets, smaller first (default tiny,small)")
    group.add_argument("--ranks", default="1,2", help="ranks per host to measure (default 1,2; '': none)")
    group.add_argument("--rounds", type=int,
                       help="rounds per run, the first a warm-up (default 4; 3 with --quick, 2 with --smoke)")
    group.add_argument("--inner-steps", type=int, help="inner steps per round (default 3; 4 with --smoke, where the "
                                                       "tiny model's steps take ~35 ms)")
    group.add_argument("--codec", default="int8", help="the swarm's codec (default int8, with error feedback)")
    group.add_argument("--outer-params",
                       help="outer state alone (what a GPU host keeps in RAM): two sizes, smaller first; '' skips it "
                            "(default 16000000,64000000; 1000000,2000000 with --smoke)")
    group.add_argument("--outer-on-disk", action="store_true",
                       help="measure the outer state alone also with outer.state_dir (θ, momentum, residual and "
                            "each round's Δ in memory-mapped files): its anonymous memory per parameter")


def _stamp(date: str, ms: str) -> float:
    return time.mktime(time.strptime(date, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def measure(model: str, ranks: int, args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gonka-mem-"))
    # A run id of its own: with --smoke two runs share the machine (``both``).
    common = ["--run-id", f"memory-{model}-{ranks}-{os.getpid()}", "--model", model, "--device", "cpu",
              "--nproc-per-node", str(ranks), "--min-peers", "2",
              "--inner-steps", str(args.inner_steps), "--max-rounds", str(args.rounds), "--metrics-addr", "off",
              "--control", "off", "--threads", "1", "--set", f"swarm.codec={args.codec}",
              "--set", "swarm.heartbeat_interval=0.5", "--set", f"data.batch_size={args.batch_size}",
              "--set", f"data.seq_len={args.seq_len}",
              "--set", "data.eval_every=0"]
    logs = [work / "a.log", work / "b.log"]
    procs = [subprocess.Popen([str(NODE_BIN), "start", *common], stdout=open(logs[0], "wb"), stderr=subprocess.STDOUT)]
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        # Walking all of /proc costs ~3 ms: the host's processes are listed once a second (its ranks
        # and p2pd start once, in round 1's warm-up), their memory read every 50 ms.
        tree, listed = [], 0.0
        while not done.is_set():
            if time.monotonic() - listed >= 1.0:
                tree, listed = process_tree(procs[0].pid), time.monotonic()
            samples.append((time.time(), sum(rss_bytes(p) for p in tree)))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        addr = listening_address(logs[0], procs[0], 300)
        if addr is None:
            raise RuntimeError(f"the first host did not start:\n{log_tail(logs[0])}")
        procs.append(subprocess.Popen([str(NODE_BIN), "start", *common, "--bootstrap", addr],
                                      stdout=open(logs[1], "wb"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 1800
        while any(p.poll() is None for p in procs):  # either host failing ends the run at once
            failed = [(p, log) for p, log in zip(procs, logs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                p, log = failed[0] if failed else (procs[0], logs[0])
                raise RuntimeError(f"{log.name} exited {p.returncode}:\n{log_tail(log)}")
            time.sleep(0.2)
        failed = [(p, log) for p, log in zip(procs, logs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"{failed[0][1].name} exited {failed[0][0].returncode}:\n{log_tail(failed[0][1])}")
    finally:
        done.set()
        sampler.join()
        stop_all(procs)
    log = logs[0].read_text()
    shutil.rmtree(work, ignore_errors=True)
    phases = [(_stamp(d, ms) - float(s), _stamp(d, ms), int(r)) for d, ms, r, s in TRAINED.findall(log)]
    phases = [p for p in phases if p[2] > 1]  # round 1 is the warm-up
    if not phases:
        raise RuntimeError(f"no trained rounds in the first host's log:\n{log[-2000:]}")
    start = phases[0][0]
    train = [m for t, m in samples if any(a <= t <= b for a, b, _ in phases)]
    if not train:
        raise RuntimeError(f"{model}, {ranks} rank(s): no 50 ms memory sample fell inside a phase of inner steps "
                           f"(the longest took {max(b - a for a, b, _ in phases):.3f} s): raise --inner-steps")
    rounds = [m for t, m in samples if t >= start and not any(a <= t <= b for a, b, _ in phases)]
    return {"model": model, "ranks": ranks, "params": state_numel(model), "train_peak_mb": max(train) / 2**20,
            "round_peak_mb": max(rounds) / 2**20 if rounds else float("nan")}


OUTER_PEER = Path(__file__).with_name("outer_memory_peer.py")
GOAL_GPU_HOST = 14  # bytes per parameter: θ 4, momentum 4, residual 4, round buffers at most 2


def measure_outer(params: int, args, on_disk: bool = False) -> dict:
    """Two hosts' outer state alone (``outer_memory_peer.py``) on loopback: the first one's peak
    resident memory in rounds 2.., from the pseudo-gradient to the end of the outer step (its
    anonymous part too: with ``on_disk``, ``outer.state_dir``, the rest is the files' pages)."""
    work = Path(tempfile.mkdtemp(prefix="gonka-outer-mem-"))
    tag = str(time.time_ns())
    procs = [subprocess.Popen([sys.executable, str(OUTER_PEER), "--index", str(i), "--workdir", str(work),
                               "--params", str(params), "--codec", args.codec, "--rounds", str(args.rounds),
                               "--run-tag", tag, *(["--state-dir", str(work / "state")] if on_disk else [])],
                              stdout=open(work / f"log{i}", "wb"), stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        for i, p in enumerate(procs):
            if p.wait(900) != 0:
                raise RuntimeError(f"outer state peer {i} exited {p.returncode}:\n{log_tail(work / f'log{i}')}")
        result = json.loads((work / "peer0.json").read_text())
    finally:
        stop_all(procs)
        shutil.rmtree(work, ignore_errors=True)
    return {"model": f"outer state{' on disk' if on_disk else ''}, {params} values", "ranks": 1, "params": params,
            "train_peak_mb": float("nan"), "round_peak_mb": max(result["peaks"][1:]) / 2**20,
            "round_anon_peak_mb": max(result["anon_peaks"][1:]) / 2**20}


def both(measure_one, first, second, side_by_side: bool) -> tuple[dict, dict]:
    """``measure_one`` of both sizes: one after the other, or side by side (--smoke, whose figures
    mean nothing: each run is mostly two hosts starting up and waiting on each other)."""
    if not side_by_side:
        return measure_one(first), measure_one(second)
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(measure_one, first), pool.submit(measure_one, second)
        return a.result(), b.result()


def run(args) -> dict:
    smoke = getattr(args, "smoke", False)
    args.rounds = args.rounds or (2 if smoke else 3 if args.quick else 4)
    # A phase of inner steps must outlast a few 50 ms samples, or none of them lands inside it.
    args.inner_steps = args.inner_steps or (4 if smoke else 3)
    # Sequences per inner step and their length: --smoke only runs the code path, with the least compute.
    args.batch_size, args.seq_len = (1, 16) if smoke else (4, 64)
    if args.outer_params is None:
        args.outer_params = "1000000,2000000" if smoke else "16000000,64000000"
    args.outer_on_disk = args.outer_on_disk or smoke  # every code path in the smoke
    if args.rounds < 2:
        raise ValueError("--rounds must be >= 2 (the first is a warm-up)")
    small, big = args.models.split(",")
    rows, summary = [], []
    if args.outer_params:
        first, second = (int(n) for n in args.outer_params.split(","))
        for on_disk in (False, True) if args.outer_on_disk else (False,):
            a, b = both(lambda n: measure_outer(n, args, on_disk), first, second, smoke)
            rows += [a, b]
            slope = {k: (b[k] - a[k]) * 2**20 / (second - first) for k in ("round_peak_mb", "round_anon_peak_mb")}
            summary.append({"ranks": "outer state on disk" if on_disk else "outer state",
                            "round_bytes_per_param": slope["round_peak_mb"],
                            "round_anon_bytes_per_param": slope["round_anon_peak_mb"], "goal": GOAL_GPU_HOST})
    for ranks in [int(r) for r in args.ranks.split(",") if r]:  # "" measures the outer state only
        a, b = both(lambda m: measure(m, ranks, args), small, big, smoke)
        rows += [a, b]
        dp = b["params"] - a["params"]
        summary.append({"ranks": ranks,
                        "train_bytes_per_param": (b["train_peak_mb"] - a["train_peak_mb"]) * 2**20 / dp,
                        "round_bytes_per_param": (b["round_peak_mb"] - a["round_peak_mb"]) * 2**20 / dp,
                        "minimum": MINIMUM_CPU})
    notes = [f"{s['ranks']} rank(s) per host: {s['train_bytes_per_param']:.1f} host bytes per parameter while "
             f"training, {s['round_bytes_per_param']:.1f} during a round (the design's minimum on a CPU host: "
             f"{s['minimum']})" if "minimum" in s else
             f"{s['ranks']} alone (a GPU host's RAM): {s['round_bytes_per_param']:.1f} host bytes per parameter during "
             f"a round, {s['round_anon_bytes_per_param']:.1f} of them anonymous (goal: {s['goal']})" for s in summary]
    return {"rows": rows, "columns": COLUMNS, "summary": summary, "notes": notes}
