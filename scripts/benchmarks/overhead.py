"""Benchmark ``overhead``: inner-step throughput of a gonka-node process vs a bare PyTorch loop.

Both train the same Hugging Face model (a small Qwen2 config, random weights
saved as safetensors) on the same prepared token shards, with the same batch,
sequence length, precision, AdamW settings and gradient clipping, on this CPU
with the same number of torch threads. The node is a real `gonka-node start`
(one peer, no bootstrap: its rounds commit alone), timed from its own
``trained round=... steps=... seconds=...`` log lines; the bare loop is a child
process that loads the model with ``from_pretrained``, draws random windows
from the same memory-mapped shard and times the same number of steps.

The two run alternately, pair by pair, so both see the same machine; the
first round (or chunk) of each is a warm-up and is left out. ``ratio`` is
node tokens/s over bare tokens/s of one pair; the goal (issue 13) is a median
of at least 0.98.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .options import positive_int

ROOT = Path(__file__).resolve().parents[2]
NODE_BIN = Path(sys.executable).with_name("gonka-node")
TRAINED = re.compile(r"trained round=(\d+) steps=(\d+) seconds=([0-9.]+)")
COLUMNS = ["pair", "node_tokens_per_s", "bare_tokens_per_s", "ratio"]
CHUNK = re.compile(r"chunk=(\d+) steps=(\d+) seconds=([0-9.]+)")
# The model both train: a small Qwen2 with tied embeddings (tests/hf_models.py's keywords).
MODEL = dict(arch="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
# --smoke: the same architecture at toy size, trained on a few documents.
SMOKE_MODEL = dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
SMOKE_SOURCES = 40

BARE_LOOP = r"""
import sys, time, numpy as np, torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM
from trainer.tokens import open_token_dataset
model_dir, data_dir, batch, seq, steps, chunks, threads, lr = sys.argv[1:9]
batch, seq, steps, chunks, threads, lr = int(batch), int(seq), int(steps), int(chunks), int(threads), float(lr)
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32,
                                             attn_implementation="sdpa")
model.train()
params = list(model.parameters())
opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                        lr=lr, betas=(0.9, 0.95), foreach=False)
tokens = open_token_dataset(data_dir, verify=False).shards[0]
rng = np.random.default_rng(0)
for chunk in range(chunks):
    start = time.perf_counter()
    total = torch.zeros(())
    for _ in range(steps):
        offsets = rng.integers(0, len(tokens) - seq - 1, batch)
        rows = torch.from_numpy(np.stack([tokens[o:o + seq + 1].astype(np.int64) for o in offsets]))
        x, y = rows[:, :-1], rows[:, 1:]
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        total += loss.detach()
    print(f"chunk={chunk} steps={steps} seconds={time.perf_counter() - start:.4f} loss={total.item() / steps:.4f}",
          flush=True)
"""


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--pairs", type=positive_int, help="node/bare pairs, median reported (default 3; 1 with --quick)")
    group.add_argument("--steps", type=positive_int,
                       help="inner steps per round / chunk (default 20; 5 with --quick, 2 with --smoke)")
    group.add_argument("--rounds", type=positive_int, help="rounds per node run, the first a warm-up (default 4; 2 with --quick)")
    group.add_argument("--threads", type=positive_int, default=1, help="torch threads of both (default 1)")
    group.add_argument("--batch", type=positive_int, help="sequences per step (default 8; 2 with --smoke)")
    group.add_argument("--seq", type=positive_int, help="tokens per sequence (default 128; 32 with --smoke)")


def prepare(work: Path, model: dict | None = None, model_dir: Path | None = None,
            sources: int = 400) -> tuple[Path, Path]:
    """A tokenizer trained on standard-library sources, a model directory with random weights
    (``model``: an architecture and config keywords for tests/hf_models.py, default ``MODEL``),
    and token shards of those sources (the first ``sources`` files, the tokenizer trained on a
    quarter of them). With ``model_dir``, that existing directory (and its own tokenizer) instead
    of a new one."""
    sys.path.insert(0, str(ROOT))
    from tests.hf_fixtures import build_tokenizer
    from tests.hf_models import build_model_dir
    from trainer.data import default_corpus_paths

    texts = [Path(p).read_text(errors="replace") for p in default_corpus_paths()[:sources]]
    text_dir = work / "text"
    text_dir.mkdir()
    for i, text in enumerate(texts):
        (text_dir / f"{i:04d}.py").write_text(text)
    if model_dir is None:
        config = dict(model or MODEL)
        arch = config.pop("arch")
        tokenizer = build_tokenizer(str(work / "tokenizer"), texts[: max(1, sources // 4)],
                                    vocab_size=config["vocab_size"])
        model_dir = Path(build_model_dir(work / "model", arch, tokenizer_dir=tokenizer, **config))
    data = work / "data"
    subprocess.run([str(NODE_BIN), "prepare-data", "--tokenizer", str(model_dir), "--out", str(data), str(text_dir)],
                   check=True, capture_output=True, timeout=600)
    return model_dir, data


def node_command(model: Path, data: Path, *, run_id: str, steps: int, rounds: int, threads: int, batch: int, seq: int,
                 precision: str, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`gonka-node start` of one peer alone (its rounds commit without a swarm), no evaluation,
    no warm-up of the learning rate; ``extra``: more flags at the end."""
    return [str(NODE_BIN), "start", "--run-id", run_id, "--model", f"hf:{model}", "--data", str(data),
            "--inner-steps", str(steps), "--max-rounds", str(rounds), "--threads", str(threads),
            "--metrics-addr", "off", "--control", "off", "--set", f"data.batch_size={batch}",
            "--set", f"data.seq_len={seq}", "--set", "data.eval_every=0", "--set", "inner.warmup_steps=0",
            "--set", f"inner.precision={precision}", *extra]


def run_node(cmd: list[str]) -> str:
    """Run a node to its end; its log (stderr)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"gonka-node failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stderr


def trained_rates(log: str, batch: int, seq: int) -> list[float]:
    """Tokens/s of each ``trained`` line of a node log after round 1 (the warm-up)."""
    found = [(int(r), int(s), float(sec)) for r, s, sec in TRAINED.findall(log)]
    return [s * batch * seq / sec for r, s, sec in found if r > 1]


def node_rate(work: Path, model: Path, data: Path, args, steps: int, rounds: int, tag: str) -> float:
    ckpt = work / f"node-{tag}"
    cmd = node_command(model, data, run_id=f"overhead-{tag}", steps=steps, rounds=rounds, threads=args.threads,
                       batch=args.batch, seq=args.seq, precision="fp32", extra=["--checkpoint-dir", str(ckpt)])
    return statistics.median(trained_rates(run_node(cmd), args.batch, args.seq))


def run_script(script: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run a bare loop (``python -c script argv...``, the repository importable) to its end; its stdout."""
    out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=1800, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"bare loop failed: {out.stderr[-2000:]}")
    return out.stdout


def chunk_rates(stdout: str, batch: int, seq: int) -> list[float]:
    """Tokens/s of each ``chunk=`` line of a bare loop after chunk 0 (the warm-up)."""
    found = [(int(c), int(s), float(sec)) for c, s, sec in CHUNK.findall(stdout)]
    return [s * batch * seq / sec for c, s, sec in found if c > 0]


def bare_rate(model: Path, data: Path, args, steps: int, chunks: int) -> float:
    stdout = run_script(BARE_LOOP, [str(model), str(data), str(args.batch), str(args.seq), str(steps), str(chunks),
                                    str(args.threads), "1e-3"])
    return statistics.median(chunk_rates(stdout, args.batch, args.seq))


def run(args: argparse.Namespace) -> dict:
    smoke = getattr(args, "smoke", False)
    pairs = args.pairs or (1 if args.quick else 3)
    steps = args.steps or (2 if smoke else 5 if args.quick else 20)
    rounds = args.rounds or (2 if args.quick else 4)
    args.batch = args.batch or (2 if smoke else 8)
    args.seq = args.seq or (32 if smoke else 128)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gonka-overhead-") as tmp:
        work = Path(tmp)
        model, data = prepare(work, **(dict(model=SMOKE_MODEL, sources=SMOKE_SOURCES) if smoke else {}))
        for pair in range(pairs):
            node = node_rate(work, model, data, args, steps, rounds, str(pair))
            bare = bare_rate(model, data, args, steps, rounds)
            rows.append({"pair": pair, "node_tokens_per_s": round(node, 1), "bare_tokens_per_s": round(bare, 1),
                         "ratio": round(node / bare, 4)})
    median = statistics.median(r["ratio"] for r in rows)
    return {"rows": rows, "columns": COLUMNS, "median_ratio": median, "goal": 0.98,
            "settings": {"steps": steps, "rounds": rounds, "threads": args.threads, "batch": args.batch, "seq": args.seq},
            "notes": [f"median node/bare throughput ratio {median:.3f} (goal >= 0.98)"]}
