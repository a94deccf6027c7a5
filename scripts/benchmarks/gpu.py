"""Benchmark ``gpu``: tokens/s and model FLOPs utilization (MFU) of a gonka-node on one GPU
vs a bare FSDP2 loop of the same model.

Both train the same Hugging Face model on the same token shards with the same batch,
sequence length, AdamW settings (fused on CUDA; lr 1e-3, betas 0.9/0.95, weight decay 0.1 on
matrices only, constant lr) and gradient clipping (norm 1.0), in bf16, on ``--device``:

- the node: a real `gonka-node start --device cuda:N --set inner.precision=bf16
  --model hf:DIR` (one peer, no bootstrap: its rounds commit alone, no checkpoints, no
  evaluation), timed from its own ``trained round=... steps=... seconds=...`` log lines. A
  single-process node trains its fp32 model under bf16 autocast; it does not wrap it in FSDP.
- the bare loop: a child process, ``torch.distributed`` with a world of one (env://, NCCL on
  CUDA, gloo on CPU), ``fully_shard`` on every decoder layer and on the root with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, random windows drawn
  from the same memory-mapped shard, each chunk of steps timed after the device has finished
  it. Neither uses ``torch.compile`` or activation checkpointing.

The model is ``--model-dir`` (an existing directory with its tokenizer) or one built here with
random weights, saved as safetensors in a temporary directory (``TMPDIR``), with a byte-level
BPE tokenizer trained on this machine's standard-library sources, whose text is also what
``gonka-node prepare-data`` turns into the shards: nothing is downloaded. The built model has
Llama's shape at about 0.85B parameters (hidden 2048, 16 layers, 16 heads with 4 KV heads, MLP
5632, 32,000 tokens, untied embeddings), enough to keep one GPU busy at batch 8 x 2048 tokens;
``--tiny`` builds a two-layer one for a smoke run on the CPU.

As in ``overhead``, node and bare loop alternate pair by pair, so both see the same machine
(and GPU clocks), and the first round (or chunk) of each is a warm-up left out; each figure is
the median over the rest. ``ratio`` is node tokens/s over bare tokens/s of one pair: what the
node's machinery costs on a GPU, including the difference between autocast over fp32
parameters and FSDP2's bf16 copies. ``node_gap_s`` is the median time between two rounds'
steps from round 2 on (pseudo-gradient to host memory, outer step, commit, loading the new
parameters): left out of tokens/s, and what a round of H steps adds once to H steps' time.

MFU = 6 N x tokens/s / peak, with N = every trainable parameter of the model (embeddings and
output layer included; 6 N is the forward and backward matmul FLOPs per token, counting an
embedding lookup as if it were one), and peak = the accelerator's dense bf16 peak:
``--peak-tflops``, or NVIDIA's datasheet figure for the device's name (A100, H100, H200, SXM /
PCIe / NVL). The ``*_mfu_attn_pct`` columns add attention's 12 L h s FLOPs per token (L layers,
hidden h, sequence s; not halved for the causal mask), as PaLM's appendix counts it. On a
device without a known peak and no ``--peak-tflops``: CUDA refuses to start (exit 2); CPU
reports tokens/s only.
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import sys
import tempfile
from pathlib import Path

from .options import int_at_least, positive_int
from .overhead import SMOKE_SOURCES, chunk_rates, node_command, prepare, run_node, run_script, trained_rates
from .utilization import phases

# Dense (no sparsity) bf16 tensor-core peak in TFLOPS, from NVIDIA's datasheets (half the
# sparse figure they print). The first entry whose words all occur in the device's name wins.
PEAK_TFLOPS = [
    ("H100 PCIE", 756.5),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4),
    ("A100", 312.0),  # SXM and PCIe, 40 and 80 GB
]
LR = "1e-3"
DEFAULT_MODEL = dict(arch="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=4)
TINY_MODEL = dict(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
SHAPE = re.compile(r"params=(\d+) layers=(\d+) hidden=(\d+)")
COLUMNS = ["pair", "node_tokens_per_s", "bare_tokens_per_s", "ratio", "node_mfu_pct", "bare_mfu_pct",
           "node_mfu_attn_pct", "bare_mfu_attn_pct", "node_gap_s"]

BARE_FSDP = r"""
import sys, time, numpy as np, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM
from trainer.tokens import open_token_dataset
model_dir, data_dir, device, batch, seq, steps, chunks, threads, lr = sys.argv[1:10]
batch, seq, steps, chunks, threads, lr = int(batch), int(seq), int(steps), int(chunks), int(threads), float(lr)
if threads:
    torch.set_num_threads(threads)
device = torch.device(device)
cuda = device.type == "cuda"
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32,
                                             attn_implementation="sdpa").to(device)
n = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"params={n} layers={model.config.num_hidden_layers} hidden={model.config.hidden_size}", flush=True)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
blocks = set(getattr(model, "_no_split_modules", None) or ())
for layer in [m for m in model.modules() if type(m).__name__ in blocks]:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
model.train()
params = list(model.parameters())
opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                        lr=lr, betas=(0.9, 0.95), fused=True if cuda else None, foreach=None if cuda else False)
tokens = open_token_dataset(data_dir, verify=False).shards[0]
rng = np.random.default_rng(0)
for chunk in range(chunks):
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        offsets = rng.integers(0, len(tokens) - seq - 1, batch)
        rows = torch.from_numpy(np.stack([tokens[o:o + seq + 1].astype(np.int64) for o in offsets]))
        x, y = rows[:, :-1].to(device, non_blocking=True), rows[:, 1:].to(device, non_blocking=True)
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        total += loss.detach().float()
    mean = total.item() / steps  # waits for the device
    print(f"chunk={chunk} steps={steps} seconds={time.perf_counter() - start:.4f} loss={mean:.4f}", flush=True)
dist.destroy_process_group()
"""


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model-dir", type=Path, help="an existing Hugging Face model directory with its tokenizer "
                       "(default: build a Llama-shaped ~0.85B model with random weights)")
    group.add_argument("--tiny", action="store_true",
                       help="build a two-layer model instead (a smoke run on the CPU; --smoke implies it)")
    group.add_argument("--device", default="cuda:0", help="cuda, cuda:N or cpu (default cuda:0)")
    group.add_argument("--batch-size", type=positive_int, help="sequences per step (default 8; 4 with --tiny); "
                       "lower it where the model does not fit the GPU")
    group.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default 2048; 64 with --tiny)")
    group.add_argument("--steps", type=positive_int,
                       help="inner steps per round / chunk (default 20; 5 with --quick, 2 with --smoke)")
    group.add_argument("--rounds", type=int_at_least(2),
                       help="rounds per node run, the first a warm-up (default 4; 2 with --quick)")
    group.add_argument("--pairs", type=positive_int, help="node/bare pairs, medians reported (default 3; 1 with --quick)")
    group.add_argument("--threads", type=int_at_least(0), default=0,
                       help="torch threads of both; 0 = torch's default (default 0)")
    group.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak in TFLOPS, for MFU (default: "
                       "looked up by the CUDA device's name for A100, H100, H200; required on other GPUs)")


def fail(message: str) -> None:
    """Bad input or no GPU: one line, exit status 2."""
    print(f"bench.py gpu: {message}", file=sys.stderr)
    raise SystemExit(2)


def peak_tflops_for(name: str) -> float | None:
    """Dense bf16 peak of a CUDA device by its name (``torch.cuda.get_device_name``), if known."""
    upper = name.upper()
    for words, tflops in PEAK_TFLOPS:
        if all(word in upper for word in words.split()):
            return tflops
    return None


def flops_per_token(params: int, layers: int, hidden: int, seq: int) -> tuple[float, float]:
    """Training FLOPs per token: 6 N, and 6 N plus attention's 12 L h s (see the module docstring)."""
    return 6.0 * params, 6.0 * params + 12.0 * layers * hidden * seq


def mfu_pct(tokens_per_s: float, flops: float, peak_tflops: float) -> float:
    """Model FLOPs utilization in percent of ``peak_tflops``."""
    return 100.0 * tokens_per_s * flops / (peak_tflops * 1e12)


def resolve_device(text: str) -> tuple[str, str]:
    """(device for both runs, its name); exits 2 on a device that is not there."""
    import torch

    if text == "cpu":
        return "cpu", "cpu"
    if not text.startswith("cuda"):
        fail(f"--device {text}: expected cuda, cuda:N or cpu")
    if not torch.cuda.is_available():
        fail(f"--device {text}: no GPU is available (torch {torch.__version__}: torch.cuda.is_available() is False)")
    try:
        index = torch.device(text).index or 0
    except RuntimeError:
        fail(f"--device {text}: expected cuda, cuda:N or cpu")
    if index >= torch.cuda.device_count():
        fail(f"--device {text}: this host has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}", torch.cuda.get_device_name(index)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def round_gaps(log: str) -> list[float]:
    """Seconds from the end of each round's steps to the start of the next one's, from round 2 on."""
    ps = phases(log)
    return [ps[k + 1]["start"] - ps[k]["end"] for k in range(1, len(ps) - 1)]


def run(args: argparse.Namespace) -> dict:
    device, name = resolve_device(args.device)
    peak = args.peak_tflops
    if peak is not None and peak <= 0:
        fail(f"--peak-tflops must be > 0 (got {peak})")
    if peak is None and device != "cpu":
        peak = peak_tflops_for(name)
        if peak is None:
            fail(f"no dense bf16 peak known for {name!r}: give it with --peak-tflops")
    if args.model_dir is not None:
        if not (args.model_dir / "config.json").is_file():
            fail(f"--model-dir {args.model_dir}: no config.json there")
        if not any((args.model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            fail(f"--model-dir {args.model_dir}: no tokenizer there (prepare-data tokenizes with the model's own)")
    smoke = getattr(args, "smoke", False)
    args.tiny = args.tiny or smoke
    batch = args.batch_size or (2 if smoke else 4 if args.tiny else 8)
    seq = args.seq_len or (32 if smoke else 64 if args.tiny else 2048)
    pairs = args.pairs or (1 if args.quick else 3)
    steps = args.steps or (2 if smoke else 5 if args.quick else 20)
    rounds = args.rounds or (2 if args.quick else 4)
    spec = dict(TINY_MODEL if args.tiny else DEFAULT_MODEL, max_position_embeddings=max(seq, 128 if args.tiny else 2048))
    rows, shape = [], None
    with tempfile.TemporaryDirectory(prefix="gonka-gpu-") as tmp:
        work = Path(tmp)
        print(f"gpu: {name} ({device}); building the model and token shards in {work} ...", file=sys.stderr, flush=True)
        model, data = prepare(work, model=spec, model_dir=args.model_dir, **({"sources": SMOKE_SOURCES} if smoke else {}))
        for pair in range(pairs):
            log = run_node(node_command(model, data, run_id=f"gpu-{pair}", steps=steps, rounds=rounds,
                                        threads=args.threads, batch=batch, seq=seq, precision="bf16",
                                        extra=["--device", device]))
            node = statistics.median(trained_rates(log, batch, seq))
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0"}
            out = run_script(BARE_FSDP, [str(model), str(data), device, str(batch), str(seq), str(steps), str(rounds),
                                         str(args.threads), LR], env=env)
            bare = statistics.median(chunk_rates(out, batch, seq))
            shape = tuple(int(v) for v in SHAPE.search(out).groups())
            gap = median_or_none(round_gaps(log))
            row = {"pair": pair, "node_tokens_per_s": round(node), "bare_tokens_per_s": round(bare),
                   "ratio": round(node / bare, 4)}
            if gap is not None:  # none with 2 rounds
                row["node_gap_s"] = round(gap, 3)
            if peak is not None:
                for key, flops in zip(("mfu_pct", "mfu_attn_pct"), flops_per_token(*shape, seq)):
                    row[f"node_{key}"] = round(mfu_pct(node, flops, peak), 2)
                    row[f"bare_{key}"] = round(mfu_pct(bare, flops, peak), 2)
            rows.append(row)
            print(f"gpu: pair {pair + 1}/{pairs}: {row}", file=sys.stderr, flush=True)
    columns = [c for c in COLUMNS if c in rows[0]]
    medians = {c: statistics.median(r[c] for r in rows) for c in columns[1:]}
    rows.append({"pair": "median", **{c: round(v, 4) for c, v in medians.items()}})
    params, layers, hidden = shape
    notes = [f"{name}: median node/bare tokens/s ratio {medians['ratio']:.3f}; model {params / 1e6:.1f}M trainable "
             f"parameters (N), {layers} layers, hidden {hidden}, batch {batch} x {seq} tokens, bf16"]
    if peak is not None:
        notes.append(f"MFU = 6N x tokens/s over a {peak:g} TFLOPS dense bf16 peak "
                     f"({'--peak-tflops' if args.peak_tflops is not None else 'by device name'}): node "
                     f"{medians['node_mfu_pct']:.2f}%, bare FSDP2 {medians['bare_mfu_pct']:.2f}% "
                     f"(with attention's 12 L h s: {medians['node_mfu_attn_pct']:.2f}% / {medians['bare_mfu_attn_pct']:.2f}%)")
    else:
        notes.append("no --peak-tflops for this device: MFU not computed")
    if medians.get("node_gap_s") is not None:
        notes.append(f"node: {medians['node_gap_s']:.3f} s between two rounds' steps (not in tokens/s)")
    return {"rows": rows, "columns": columns, "medians": medians, "peak_tflops": peak,
            "device": {"device": device, "name": name},
            "model": {"dir": str(args.model_dir) if args.model_dir else "built", "params": params, "layers": layers,
                      "hidden": hidden, **({} if args.model_dir else {"config": spec})},
            "settings": {"batch": batch, "seq": seq, "steps": steps, "rounds": rounds, "pairs": pairs,
                         "threads": args.threads, "precision": "bf16", "lr": float(LR)},
            "notes": notes}
