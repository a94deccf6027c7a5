"""Benchmark ``dataloader``: the sampler's samples/s and RSS over a 2 GB token shard.

One dataset of --gb GB of random uint16 tokens (one shard, written as
prepare-data writes them), then for each (batch size, sequence length) a
fresh child process opens it and draws batches for about --seconds:

- ``mmap``: ShardSampler over the memory-mapped dataset, as training reads it;
  it hands each window's pages back after copying it (TokenDataset.release_pages),
  so ``rss_growth_MB`` should stay near zero however long it runs.
- ``in_memory``: the same sampler over the shard read whole into memory, the
  speed reference (its RSS includes the whole shard).

``rss_*`` are the child's VmRSS; growth is measured from just after opening the
data (for in_memory: after reading it). The page cache is warm (the shard was
just written and hashed), as it is on a training host after the first pass.
``verify_GB_s`` is open_token_dataset(verify=True)'s sha256 speed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time

import numpy as np

from trainer.data import ShardSampler
from trainer.tokens import ShardWriter, open_token_dataset

from .options import positive_int

COLUMNS = ["source", "batch_size", "seq_len", "batches", "samples_s", "Mtokens_s", "rss_start_MB", "rss_end_MB",
           "rss_peak_MB", "rss_growth_MB"]
SHAPES = [(8, 1024), (32, 2048)]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--gb", type=float, help="dataset size in GB (default 2.1; 0.25 with --quick, 0.01 with --smoke)")
    group.add_argument("--seconds", type=float, help="sampling time per row (default 10; 2 with --quick)")
    group.add_argument("--batches", type=positive_int,
                       help="batches per row instead of a time budget (default: none; 20 with --smoke)")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _measure(path: str, source: str, batch_size: int, seq_len: int, seconds: float, batches: int | None) -> dict:
    """In a fresh child process: draw batches and watch VmRSS."""
    dataset = open_token_dataset(path, verify=False)
    data = dataset if source == "mmap" else [np.fromfile(f, dtype=np.uint16, offset=256) for f in dataset.shard_paths]
    sampler = ShardSampler(data, shard_key="bench", seed=0, batch_size=batch_size, seq_len=seq_len, eval_fraction=0.01)
    start = _rss_mb()
    peak, drawn = start, 0
    t0 = time.perf_counter()
    while (drawn < batches) if batches else (time.perf_counter() - t0 < seconds):
        sampler.next_batch()
        drawn += 1
        if drawn % 100 == 0:
            peak = max(peak, _rss_mb())
    elapsed = time.perf_counter() - t0
    end = _rss_mb()
    return {
        "source": source,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "batches": drawn,
        "samples_s": drawn * batch_size / elapsed,
        "Mtokens_s": drawn * batch_size * seq_len / elapsed / 1e6,
        "rss_start_MB": start,
        "rss_end_MB": end,
        "rss_peak_MB": max(peak, end),
        "rss_growth_MB": max(peak, end) - start,
    }


def write_dataset(path: str, tokens: int) -> float:
    """A one-shard dataset of ``tokens`` random uint16 tokens; returns the seconds it took."""
    os.makedirs(path)
    t0 = time.perf_counter()
    writer = ShardWriter(path, dtype="uint16", shard_tokens=tokens)
    rng = np.random.default_rng(0)
    left = tokens
    while left:
        n = min(left, 1 << 26)
        writer.add(rng.integers(0, 50_000, n, dtype=np.uint16))
        left -= n
    tokenizer = {"sha256": "0" * 64, "vocab_size": 50_000, "eos_id": 0, "eos_token": "", "source": "random tokens"}
    writer.finish(tokenizer=tokenizer, documents=1)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    smoke = getattr(args, "smoke", False)
    gb = args.gb or (0.01 if smoke else 0.25 if args.quick else 2.1)
    seconds = args.seconds or (2.0 if args.quick else 10.0)
    if smoke and not args.seconds:
        args.batches = args.batches or 20
    tokens = int(gb * 1e9) // 2
    work = tempfile.mkdtemp(prefix="bench-dataloader-")
    try:
        path = os.path.join(work, "dataset")
        write_s = write_dataset(path, tokens)
        t0 = time.perf_counter()
        open_token_dataset(path, verify=True)
        verify_s = time.perf_counter() - t0
        ctx = multiprocessing.get_context("spawn")
        rows = []
        for batch_size, seq_len in SHAPES:
            for source in ("mmap", "in_memory"):
                with ctx.Pool(1) as pool:  # a fresh process per row: RSS of this row only
                    rows.append(pool.apply(_measure, (path, source, batch_size, seq_len, seconds, args.batches)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = tokens * 2
    mmap_growth = max(r["rss_growth_MB"] for r in rows if r["source"] == "mmap")
    return {
        "dataset_bytes": size,
        "write_s": write_s,
        "verify_s": verify_s,
        "verify_GB_s": size / verify_s / 1e9,
        "columns": COLUMNS,
        "rows": rows,
        "notes": [f"one shard of {size / 1e9:.2f} GB (uint16), ~{seconds:g} s per row, each in a fresh process; "
                  f"written in {write_s:.1f} s, verified (sha256) at {size / verify_s / 1e9:.2f} GB/s; "
                  f"largest RSS growth over the memory map: {mmap_growth:.1f} MB"],
    }
