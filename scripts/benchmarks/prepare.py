"""Benchmark ``prepare``: `gonka-node prepare-data`'s tokens/s against the tokenizer alone.

The same documents (this machine's Python standard library sources, each
file one document, the list repeated --copies times) and the same tokenizer
(byte-level BPE with a --vocab vocabulary trained on a sample of them), with
1 and 2 processes side by side:

- ``prepare``: the command end to end, as a user runs it (`python -m node.cli
  prepare-data ...`: Python starting, the workers starting, reading the files,
  tokenizing, writing and hashing the shards and the manifest).
- ``bare``: ``tokenizers``' ``encode_batch`` alone over the same documents,
  already in memory, split evenly between the same number of processes, each
  single-threaded like prepare's workers; ``bare_fast`` is ``encode_batch_fast``
  (no character offsets), which prepare itself calls.

``ratio`` = prepare / bare tokens per second; the goal is at least 0.9, i.e.
the pipeline costs at most a tenth on top of tokenizing. Medians of --repeats
runs; other load on the machine (the load average is recorded) slows both.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.hf_fixtures import build_tokenizer
from trainer.tokens import open_token_dataset

from .options import positive_int

ROOT = Path(__file__).resolve().parents[2]
GOAL_RATIO = 0.9
COLUMNS = ["processes", "tokens", "prepare_tok_s", "bare_tok_s", "bare_fast_tok_s", "ratio", "meets_0.9",
           "ratio_vs_fast", "prepare_s"]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--copies", type=positive_int, help="times the list of documents is repeated (default 3; 1 with --quick)")
    group.add_argument("--repeats", type=positive_int,
                       help="timed runs of each, median reported (default 5; 2 with --quick, 1 with --smoke)")
    group.add_argument("--vocab", type=positive_int, help="tokenizer vocabulary (default 8192; 512 with --smoke)")


def _encode_share(tokenizer_file: str, files: list[str], repeats: int, queue) -> None:
    """One bare process: read its documents, then time encode_batch(_fast) over them ``repeats`` times."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process, one core: as prepare's workers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_file)
    texts = []
    for file in files:
        with open(file, "rb") as f:
            texts.append(f.read().decode())
    slow, fast, tokens = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        t1 = time.perf_counter()
        tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        t2 = time.perf_counter()
        slow.append(t1 - t0)
        fast.append(t2 - t1)
        tokens = sum(len(e.ids) for e in encodings) + len(texts)  # + one EOS each, as prepare writes
    queue.put((tokens, slow, fast))


def bare(tokenizer_file: str, files: list[str], processes: int, repeats: int) -> tuple[int, list[float], list[float]]:
    """(tokens, per-repeat seconds of encode_batch, of encode_batch_fast): the slowest process each time."""
    shares: list[list[str]] = [[] for _ in range(processes)]
    sizes = [0] * processes
    for file in sorted(files, key=os.path.getsize, reverse=True):  # balance the bytes
        i = sizes.index(min(sizes))
        shares[i].append(file)
        sizes[i] += os.path.getsize(file)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_encode_share, args=(tokenizer_file, share, repeats, queue)) for share in shares]
    for w in workers:
        w.start()
    results = [queue.get(timeout=1800) for _ in workers]
    for w in workers:
        w.join()
    tokens = sum(r[0] for r in results)
    slow = [max(r[1][i] for r in results) for i in range(repeats)]
    fast = [max(r[2][i] for r in results) for i in range(repeats)]
    return tokens, slow, fast


def run(args: argparse.Namespace) -> dict:
    # Here, not at the top: the bare processes import this module, and trainer.data imports torch.
    from trainer.data import default_corpus_paths

    smoke = getattr(args, "smoke", False)
    copies = args.copies or (1 if args.quick else 3)
    repeats = args.repeats or (1 if smoke else 2 if args.quick else 5)
    args.vocab = args.vocab or (512 if smoke else 8192)
    corpus = default_corpus_paths()
    if args.quick:
        corpus = corpus[: 40 if smoke else 200]
    files = corpus * copies
    text_bytes = sum(os.path.getsize(f) for f in files)
    work = tempfile.mkdtemp(prefix="bench-prepare-")
    try:
        sample = []
        for file in corpus[: len(corpus) // 4]:
            with open(file, encoding="utf-8") as f:
                sample.append(f.read())
        tokenizer_dir = build_tokenizer(os.path.join(work, "tokenizer"), texts=sample, vocab_size=args.vocab)
        tokenizer_file = os.path.join(tokenizer_dir, "tokenizer.json")
        load_before = os.getloadavg()
        rows = []
        for processes in (1, 2):
            prepare_s, tokens = [], 0
            for i in range(repeats):
                out = os.path.join(work, f"out-{processes}-{i}")
                command = [sys.executable, "-m", "node.cli", "prepare-data", "--tokenizer", tokenizer_dir, "--out", out,
                           "--workers", str(processes), "--no-progress", *files]
                t0 = time.perf_counter()
                subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=3600)
                prepare_s.append(time.perf_counter() - t0)
                tokens = open_token_dataset(out, verify=False).total_tokens
                shutil.rmtree(out)
            bare_tokens, slow, fast = bare(tokenizer_file, files, processes, repeats)
            assert bare_tokens == tokens, (bare_tokens, tokens)  # the same work on both sides
            p, s, f = statistics.median(prepare_s), statistics.median(slow), statistics.median(fast)
            rows.append({
                "processes": processes,
                "tokens": tokens,
                "prepare_tok_s": tokens / p,
                "bare_tok_s": tokens / s,
                "bare_fast_tok_s": tokens / f,
                "ratio": s / p,
                "meets_0.9": s / p >= GOAL_RATIO,
                "ratio_vs_fast": f / p,
                "prepare_s": p,
                "prepare_s_all": prepare_s,
                "bare_s_all": slow,
                "bare_fast_s_all": fast,
            })
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()[0]
    return {
        "documents": len(files),
        "text_bytes": text_bytes,
        "vocab": args.vocab,
        "repeats": repeats,
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m_before_after": [load_before[0], load_after],
        "goal_ratio": GOAL_RATIO,
        "columns": COLUMNS,
        "rows": rows,
        "notes": [f"{len(files)} documents, {text_bytes / 1e6:.1f} MB of text, vocabulary {args.vocab}, median of {repeats}; "
                  f"{len(os.sched_getaffinity(0))} CPUs, load average {load_before[0]:.2f} -> {load_after:.2f}; "
                  f"ratio = prepare-data / bare encode_batch tokens/s, goal >= {GOAL_RATIO}"],
    }
