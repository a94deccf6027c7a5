"""Benchmark ``planfit``: `gonka-node plan`'s memory per rank against a real host's, per mode.

For each inner-loop memory mode (``--modes``), one host of 2 CPU ranks (real `gonka-node
start`, ``--device cpu``, ``--nproc-per-node 2``, FSDP2 over gloo, ``--min-peers 1``, fp32
codec, no kept averages: a multi-rank host keeps none) trains ``--rounds`` rounds of ``--model``.
Every 50 ms each rank's peak resident memory (``VmHWM``) is read; the last reading is the
rank's peak over the run. The hosts run with ``MALLOC_MMAP_THRESHOLD_`` = 128 KiB: glibc then
serves every larger allocation from mmap and gives it back when freed, so the peak is what was
live, as the plan counts it (with glibc's default, its heaps kept freed temporaries and a rank
of the base preset peaked at twice the plan). ``plan_mb`` is what trainer/plan.py says one CPU rank holds for the
same model, mode, batch and sequence: the mode's parameters, gradients, optimizer state, gather
buffers, activations and loss (trainer/plan.py ``plan_run``, ``device = cpu``), the rank's
runtime (``CPU_RANK_RUNTIME``), and its share of the outer state. ``ratio`` = measured / plan,
for rank 1 (the follower: the training alone) and rank 0 (also the node: swarm, DHT, state
server). Goal: rank 1 within 15% of the plan.

With ``--smoke`` (tiny model, one mode, figures that mean nothing) the code path runs only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.swarmbench_common import NODE_BIN, log_tail, process_tree, rss_bytes, stop_all

MMAP_THRESHOLD = 128 * 1024
COLUMNS = ["mode", "model", "rank1_mb", "rank0_mb", "plan_mb", "rank1_ratio", "rank0_ratio"]
MODES = {
    "fp32": [],
    "fp32+8bit": ["--set", "inner.optimizer_state=8bit"],
    "bf16": ["--set", "inner.param_dtype=bf16"],
    "bf16+8bit": ["--set", "inner.param_dtype=bf16", "--set", "inner.optimizer_state=8bit"],
    "offload-all": ["--set", "inner.offload=all"],
}
PLAN_MODE = {"fp32": "fp32 masters", "fp32+8bit": "fp32 + 8-bit AdamW", "bf16": "bf16",
             "bf16+8bit": "bf16 + 8-bit AdamW", "offload-all": "fp32, offload all"}


def add_arguments(group) -> None:
    group.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default all)")
    group.add_argument("--model", help="preset (default base; tiny with --smoke)")
    group.add_argument("--rounds", type=int, help="rounds per run (default 2)")
    group.add_argument("--inner-steps", type=int, help="inner steps per round (default 2)")
    group.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step (default 2)")
    group.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")


def _rank_of(pid: int) -> int | None:
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    except (OSError, ValueError):
        pass
    return None


def measure(mode: str, args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gonka-planfit-"))
    argv = [str(NODE_BIN), "start", "--run-id", f"planfit-{os.getpid()}", "--model", args.model, "--device", "cpu",
            "--nproc-per-node", "2", "--min-peers", "1", "--inner-steps", str(args.inner_steps),
            "--max-rounds", str(args.rounds), "--metrics-addr", "off", "--control", "off", "--threads", "1",
            "--set", "swarm.catchup_rounds=0", "--set", f"data.batch_size={args.batch_size}",
            "--set", f"data.seq_len={args.seq_len}", "--set", "data.eval_every=0", *MODES[mode]]
    log = work / "node.log"
    # Large allocations straight from mmap, so that freeing them returns them: resident memory is
    # then what is live, not what glibc's heaps keep of freed temporaries (which doubled a CPU
    # rank's peak here: docs/memory.md). A GPU's counterpart is max_memory_allocated.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    peaks: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        ranks, listed = {}, 0.0
        while not done.is_set():
            if time.monotonic() - listed >= 1.0:
                ranks = {r: p for p in process_tree(proc.pid) if (r := _rank_of(p)) is not None}
                listed = time.monotonic()
            for r, p in ranks.items():
                peaks[r] = max(peaks.get(r, 0), rss_bytes(p, "VmHWM"))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc.wait(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode}: the host exited {proc.returncode}:\n{log_tail(log)}")
    finally:
        done.set()
        sampler.join()
        stop_all([proc])
        shutil.rmtree(work, ignore_errors=True)
    if sorted(peaks) != [0, 1]:
        raise RuntimeError(f"{mode}: ranks seen: {sorted(peaks)}")
    return {"mode": mode, "model": args.model, "rank1_mb": peaks[1] / 2**20, "rank0_mb": peaks[0] / 2**20}


def planned(mode: str, args) -> float:
    """Bytes one CPU rank holds, as the plan says."""
    from trainer.plan import CPU_RANK_RUNTIME, Hardware, Run, plan_run

    plan = plan_run(args.model, Hardware(device="cpu", nproc=2, host_memory=2**50),
                    Run(batch_size=args.batch_size, seq_len=args.seq_len, inner_steps=args.inner_steps, peers=1,
                        codec="fp32", catchup_rounds=0))
    m = next(m for m in plan.modes if m.mode == PLAN_MODE[mode] and not m.activation_checkpointing)
    shared = ("outer_state", "round_average", "round_inputs", "offloaded")
    return m.gpu_total + CPU_RANK_RUNTIME + sum(m.host.get(k, 0.0) for k in shared) / 2


def run(args) -> dict:
    smoke = getattr(args, "smoke", False)
    args.model = args.model or ("tiny" if smoke else "base")
    args.rounds = args.rounds or 2
    args.inner_steps = args.inner_steps or 2
    modes = ["bf16+8bit"] if smoke else [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"planfit: --modes: {bad[0]!r} is not one of {', '.join(MODES)}")
    rows = []
    for mode in modes:
        row = measure(mode, args)
        row["plan_mb"] = planned(mode, args) / 2**20
        row["rank1_ratio"] = row["rank1_mb"] / row["plan_mb"]
        row["rank0_ratio"] = row["rank0_mb"] / row["plan_mb"]
        print(f"  {mode}: rank 1 {row['rank1_mb']:.0f} MB, rank 0 {row['rank0_mb']:.0f} MB, plan "
              f"{row['plan_mb']:.0f} MB ({row['rank1_ratio']:.2f}x)", flush=True)
        rows.append(row)
    return {"rows": rows, "columns": COLUMNS, "model": args.model, "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "targets": {"rank1_within_15pct_of_plan": all(abs(r["rank1_ratio"] - 1) <= 0.15 for r in rows)}}
