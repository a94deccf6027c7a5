"""Benchmark `convergence`: DiLoCo vs data-parallel training vs one worker, in one process.

All runs share the model, the data shards, AdamW and its schedule (--ddp-inner-lr
may give the data-parallel baseline its own peak lr):
- DiLoCo: k workers (the in-process simulator, the same code a swarm peer runs),
  H inner steps per round, token-weighted outer Nesterov step;
- DDP: k workers whose gradients are averaged every step (same global batch and
  same total tokens as DiLoCo);
- single: one worker alone for the same number of steps (k times fewer tokens);
- DiLoCo again with pseudo-gradients compressed by --codec (default fp4), with
  and without error feedback, through the same encode/average/re-encode
  functions the swarm's all-reduce uses (p2p/compression.py);
- DiLoCo with the sparse codec(s) of --sparse (default sparse: 1.56% of the
  values at 2 bits) and SparseLoCo's outer step: plain SGD at --sparse-outer-lr,
  error feedback decayed by --sparse-decay in the role of the momentum;
- DiLoCo fp32 with overlapped rounds (--overlap, default eager): each round's
  average lands after --land-after (default 0.5) of the next round's inner
  steps, as on a node whose all-reduce takes half a round, and the local copy
  moves with θ from then on. Its curve counts the tokens of committed rounds.

Eval loss is measured on the fixed held-out split after every H steps.
Bytes per worker are what each worker sends on the wire with a butterfly (or
ring) all-reduce: 2(k-1)/k x encoded size of the parameters per sync (4 bytes
per value in fp32); DiLoCo syncs once per round, DDP once per step.

The defaults (H = 130, 8 rounds, outer lr 1.0, momentum 0.8) are where the
compressed run meets its goals (within 1% of fp32 DiLoCo at >= 1000x fewer
bytes than DDP). DiLoCo within 2% of DDP at >= 100x fewer bytes is met in
the other regime: ``--inner-steps 13 --rounds 80 --outer-lr 0.8
--outer-momentum 0.8`` (H = 13 is the smallest H at which fp4 sends >= 100x
fewer bytes than DDP; same tokens), where fp4 + error feedback ended -0.2%,
+2.0% and +0.7% from DDP with seeds 0, 1 and 2. The result's ``targets`` says
which goals a run met.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from p2p.codecs import get_codec
from p2p.compression import CompressingMember, exchange_bytes
from trainer.baselines import DataParallel
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import load_corpus
from trainer.simulator import Simulator


# Inner AdamW peak lr of every run: the trainer's default. Measured (800 steps, batch 4 x 64):
# data-parallel training does better at 3e-3 (eval 1.887 vs 2.070), DiLoCo does worse (H=20:
# 2.346 vs 2.172); --ddp-inner-lr 3e-3 gives the baseline its own, better lr.
INNER_LR = 1e-3
# Outer step of the DiLoCo runs. Measured at H=100, 8 rounds: lr 1.0 / momentum 0.8 reached 2.257,
# the trainer's default 0.7 / 0.9 2.290, 1.0 / 0.9 2.281, 0.4 / 0.9 2.372.
OUTER_LR = 1.0
OUTER_MOMENTUM = 0.8
# SparseLoCo's step for the sparse runs: the best of the sweep (docs/benchmarks.md#sweep: 4 workers,
# H = 30, 35 rounds; lr 3 1.859, 4 1.815, 6 1.870 at decay 0.95; decay 0.99 1.888).
SPARSE_OUTER_LR = 4.0
SPARSE_DECAY = 0.95


# Inner-loop memory modes (trainer/memory.py) the benchmark compares with fp32 masters.
MEMORY_MODES = {
    "bf16": dict(param_dtype="bf16"),
    "8bit": dict(optimizer_state="8bit"),
    "bf16+8bit": dict(param_dtype="bf16", optimizer_state="8bit"),
}


def add_arguments(group) -> None:
    group.add_argument("--workers", type=int, default=0, help="k workers (default 4; 2 with --smoke)")
    group.add_argument("--inner-steps", type=int, default=0, help="H (default 130; 20 with --quick, 2 with --smoke)")
    group.add_argument("--rounds", type=int, default=0, help="outer rounds (default 8; 6 with --quick, 2 with --smoke)")
    group.add_argument("--batch-size", type=int, default=0, help="sequences per worker step (default 4)")
    group.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default 64)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--codec", default="fp4", help="codec of the compressed DiLoCo runs (default fp4)")
    group.add_argument("--inner-lr", type=float, default=INNER_LR, help=f"peak AdamW lr of every run, DDP's too unless --ddp-inner-lr (default {INNER_LR})")
    group.add_argument("--ddp-inner-lr", type=float, default=0.0,
                       help="peak AdamW lr of the data-parallel run (default: --inner-lr)")
    group.add_argument("--warmup-steps", type=int, default=-1,
                       help="inner lr warmup steps (default: a tenth of the run, at most 100)")
    group.add_argument("--outer-lr", type=float, default=OUTER_LR, help=f"DiLoCo outer lr (default {OUTER_LR})")
    group.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM,
                       help=f"DiLoCo outer Nesterov momentum (default {OUTER_MOMENTUM})")
    group.add_argument("--sparse", default="sparse",
                       help="comma list of sparse codecs run with SparseLoCo's outer step; 'none' for none "
                            "(default sparse)")
    group.add_argument("--sparse-outer-lr", type=float, default=SPARSE_OUTER_LR,
                       help=f"outer lr of the sparse runs (default {SPARSE_OUTER_LR})")
    group.add_argument("--sparse-decay", type=float, default=SPARSE_DECAY,
                       help=f"error feedback's decay in the sparse runs (default {SPARSE_DECAY})")
    group.add_argument("--overlap", default="eager",
                       help="comma list of overlap modes (delayed, eager) run as extra fp32 DiLoCo curves; "
                            "'none' for none (default eager)")
    group.add_argument("--land-after", type=float, default=0.5,
                       help="overlapped runs: fraction of the next round's steps after which an average lands "
                            "(default 0.5; 1.0 = at the end of the round)")
    group.add_argument("--memory-modes", default="bf16,8bit,bf16+8bit",
                       help="comma list of inner-loop memory modes run as extra fp32 DiLoCo curves: bf16 "
                            "(parameters, stochastic rounding), 8bit (AdamW state), bf16+8bit; 'none' for none "
                            "(default bf16,8bit,bf16+8bit)")
    group.add_argument("--threads", type=int, default=1,
                       help="torch CPU threads (default 1: the tiny model gains nothing from more, and on shared "
                            "cores extra threads spin and slow every step down)")


def _configs(args):
    steps = args.inner_steps * args.rounds
    data = DataConfig(batch_size=args.batch_size, seq_len=args.seq_len)
    warmup = args.warmup_steps if args.warmup_steps >= 0 else min(100, steps // 10)
    inner = InnerConfig(steps=args.inner_steps, lr=args.inner_lr, warmup_steps=warmup, total_steps=steps)
    return ModelConfig(source="tiny"), data, inner


def _defaults(args) -> None:
    quick, smoke = args.quick, getattr(args, "smoke", False)
    # H = 130 is the smallest H at which fp4 sends >= 1000x fewer bytes than data-parallel
    # training (130 x 7.76); 8 rounds of batch 4 x 64 keep the full run near 10 minutes on 2 cores.
    args.workers = args.workers or (2 if smoke else 4)
    args.inner_steps = args.inner_steps or (2 if smoke else 20 if quick else 130)
    args.rounds = args.rounds or (2 if smoke else 6 if quick else 8)
    args.batch_size = args.batch_size or 4
    args.seq_len = args.seq_len or 64
    if min(args.workers, args.inner_steps, args.rounds, args.batch_size, args.seq_len, args.threads) < 1:
        raise SystemExit("convergence: --workers, --inner-steps, --rounds, --batch-size, --seq-len, --threads must be >= 1")
    modes = [] if args.overlap.strip() == "none" else [m.strip() for m in args.overlap.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("delayed", "eager")]
    if bad:
        raise SystemExit(f"convergence: --overlap: {bad[0]!r} is not delayed, eager or none")
    args.overlap_modes = modes
    mem = [] if args.memory_modes.strip() == "none" else [m.strip() for m in args.memory_modes.split(",") if m.strip()]
    bad = [m for m in mem if m not in MEMORY_MODES]
    if bad:
        raise SystemExit(f"convergence: --memory-modes: {bad[0]!r} is not one of {', '.join(MEMORY_MODES)} or none")
    args.memory_mode_list = mem
    args.sparse_list = [] if args.sparse.strip() == "none" else [c.strip() for c in args.sparse.split(",") if c.strip()]
    for name in args.sparse_list:
        try:
            get_codec(name)
        except ValueError as e:
            raise SystemExit(f"convergence: --sparse: {e}") from None
    if not 0 < args.sparse_decay <= 1:
        raise SystemExit("convergence: --sparse-decay must be in (0, 1]")
    if not 0.0 <= args.land_after <= 1.0:
        raise SystemExit("convergence: --land-after must be in [0, 1]")


def run(args: argparse.Namespace) -> dict:
    _defaults(args)
    k, H, R = args.workers, args.inner_steps, args.rounds
    model, data, inner = _configs(args)
    try:
        outer = OuterConfig(lr=args.outer_lr, momentum=args.outer_momentum)
    except ValueError as e:
        raise SystemExit(f"convergence: {e}") from None
    torch.set_num_threads(args.threads)
    corpus = load_corpus([])
    tokens_per_worker_step = args.batch_size * args.seq_len
    curves: dict[str, list[tuple[int, float]]] = {}
    seconds: dict[str, float] = {}

    codec = get_codec(args.codec)

    def diloco(name: str, workers: int, outer: OuterConfig, wrap=None, memory: dict | None = None) -> float:
        started = time.perf_counter()
        sim = Simulator(workers, model=model, data=data, inner=dataclasses.replace(inner, **(memory or {})),
                        outer=outer, corpus=corpus, seed=args.seed, wrap=wrap, land_after=args.land_after)
        records = sim.run_sync(R, H)
        per_round = H * workers * tokens_per_worker_step
        if outer.overlap == "off":
            curves[name] = [((i + 1) * per_round, r["eval_loss"]) for i, r in enumerate(records)]
        else:  # after round i's steps, i - 1 rounds are committed; run_sync applied the last at the end
            curves[name] = [(i * per_round, r["eval_loss"]) for i, r in enumerate(records) if i > 0]
            curves[name].append((R * per_round, sim.workers[0].eval_loss()))
        seconds[name] = time.perf_counter() - started
        final = curves[name][-1][1]
        print(f"  {name}: eval loss {final:.4f} ({seconds[name]:.0f}s)", flush=True)
        return final

    diloco_loss = diloco("diloco", k, outer)
    compressed_loss = diloco(f"diloco_{codec.name}_ef", k, outer,
                             wrap=lambda i, m: CompressingMember(m, codec, k, feedback=True))
    no_feedback_loss = diloco(f"diloco_{codec.name}", k, outer,
                              wrap=lambda i, m: CompressingMember(m, codec, k, feedback=False))
    sparse_outer = OuterConfig(lr=args.sparse_outer_lr, momentum=0.0, nesterov=False)
    sparse_runs = {name: diloco(f"diloco_{name}_sparseloco", k, sparse_outer,
                                wrap=lambda i, m, c=get_codec(name): CompressingMember(m, c, k, decay=args.sparse_decay))
                   for name in args.sparse_list}
    overlapped = {mode: diloco(f"diloco_{mode}", k, dataclasses.replace(outer, overlap=mode))
                  for mode in args.overlap_modes}
    in_memory_modes = {mode: diloco(f"diloco_{mode}", k, outer, memory=MEMORY_MODES[mode])
                       for mode in args.memory_mode_list}
    # One worker, outer lr 1 and no momentum: plain AdamW (the outer step just adopts θ_local).
    single_loss = diloco("single", 1, OuterConfig(lr=1.0, momentum=0.0, nesterov=False))

    started = time.perf_counter()
    ddp_inner = inner
    if args.ddp_inner_lr > 0:
        ddp_inner = InnerConfig(steps=inner.steps, lr=args.ddp_inner_lr, warmup_steps=inner.warmup_steps,
                                total_steps=inner.total_steps)
    ddp = DataParallel(k, model=model, data=data, inner=ddp_inner, corpus=corpus, seed=args.seed)
    curves["ddp"] = []
    for r in range(R):
        ddp.train(H)
        curves["ddp"].append(((r + 1) * H * ddp.tokens_per_step, ddp.eval_loss()))
    seconds["ddp"] = time.perf_counter() - started
    ddp_loss = curves["ddp"][-1][1]
    print(f"  ddp: eval loss {ddp_loss:.4f} ({seconds['ddp']:.0f}s)", flush=True)

    params = sum(p.numel() for p in ddp.holder.global_params)
    per_sync = 2 * (k - 1) / k * params * 4
    per_sync_compressed = 2 * (k - 1) / k * codec.wire_bytes(params)

    result = {
        "workers": k,
        "inner_steps": H,
        "rounds": R,
        "codec": codec.name,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "inner_lr": inner.lr,
        "ddp_inner_lr": ddp_inner.lr,
        "warmup_steps": inner.warmup_steps,
        "outer_lr": outer.lr,
        "outer_momentum": outer.momentum,
        "outer_nesterov": outer.nesterov,
        "land_after": args.land_after,
        "parameters": params,
        "tokens": R * H * k * tokens_per_worker_step,
        "diloco_eval_loss": diloco_loss,
        "ddp_eval_loss": ddp_loss,
        "single_eval_loss": single_loss,
        "diloco_bytes_per_worker": int(per_sync * R),
        "ddp_bytes_per_worker": int(per_sync * R * H),
        "diloco_uncompressed_eval_loss": diloco_loss,
        "diloco_compressed_eval_loss": compressed_loss,
        "diloco_no_feedback_eval_loss": no_feedback_loss,
        "diloco_compressed_bytes_per_worker": int(per_sync_compressed * R),
        **{f"diloco_{c}_eval_loss": loss for c, loss in sparse_runs.items()},
        **{f"{c}_vs_uncompressed_loss": loss / diloco_loss - 1 for c, loss in sparse_runs.items()},
        # What a worker sends per sync: its input to the other owners, its part's average to the others.
        **{f"diloco_{c}_bytes_per_worker": int(exchange_bytes(get_codec(c), params, k) * R) for c in sparse_runs},
        **{f"diloco_{m}_eval_loss": loss for m, loss in overlapped.items()},
        **{f"{m}_vs_uncompressed_loss": loss / diloco_loss - 1 for m, loss in overlapped.items()},
        **{f"diloco_{m}_eval_loss": loss for m, loss in in_memory_modes.items()},
        **{f"{m}_vs_fp32_masters_loss": loss / diloco_loss - 1 for m, loss in in_memory_modes.items()},
        "diloco_vs_ddp_loss": diloco_loss / ddp_loss - 1,
        "compressed_vs_uncompressed_loss": compressed_loss / diloco_loss - 1,
        "compressed_vs_ddp_loss": compressed_loss / ddp_loss - 1,
        "no_feedback_vs_uncompressed_loss": no_feedback_loss / diloco_loss - 1,
        "ddp_vs_diloco_bytes": H,
        "ddp_vs_compressed_bytes": per_sync * H / per_sync_compressed,
        # The project's goals, checked on this run's figures.
        "targets": {
            "diloco_loss_within_2pct_of_ddp": diloco_loss <= 1.02 * ddp_loss,
            "diloco_100x_fewer_bytes_than_ddp": H >= 100,
            "compressed_loss_within_1pct_of_diloco": compressed_loss <= 1.01 * diloco_loss,
            "compressed_loss_within_2pct_of_ddp": compressed_loss <= 1.02 * ddp_loss,
            "compressed_100x_fewer_bytes_than_ddp": per_sync * H / per_sync_compressed >= 100,
            "compressed_1000x_fewer_bytes_than_ddp": per_sync * H / per_sync_compressed >= 1000,
            **{f"{m}_within_1pct_of_fp32_masters": loss <= 1.01 * diloco_loss for m, loss in in_memory_modes.items()},
        },
        "seconds": seconds,
        "curves": curves,
    }
    result["rows"] = [
        {"run": "diloco", "eval_loss": diloco_loss, "tokens": result["tokens"], "bytes_per_worker": result["diloco_bytes_per_worker"]},
        {"run": "ddp", "eval_loss": ddp_loss, "tokens": result["tokens"], "bytes_per_worker": result["ddp_bytes_per_worker"]},
        {"run": "single", "eval_loss": single_loss, "tokens": result["tokens"] // k, "bytes_per_worker": 0},
        {"run": f"diloco {codec.name} + error feedback", "eval_loss": compressed_loss, "tokens": result["tokens"],
         "bytes_per_worker": result["diloco_compressed_bytes_per_worker"]},
        {"run": f"diloco {codec.name}, no feedback", "eval_loss": no_feedback_loss, "tokens": result["tokens"],
         "bytes_per_worker": result["diloco_compressed_bytes_per_worker"]},
    ]
    result["rows"] += [{"run": f"diloco {c} + SparseLoCo step", "eval_loss": loss, "tokens": result["tokens"],
                        "bytes_per_worker": result[f"diloco_{c}_bytes_per_worker"]} for c, loss in sparse_runs.items()]
    result["rows"] += [{"run": f"diloco, {m} overlap", "eval_loss": loss, "tokens": result["tokens"],
                        "bytes_per_worker": result["diloco_bytes_per_worker"]} for m, loss in overlapped.items()]
    result["rows"] += [{"run": f"diloco, {m} inner loop", "eval_loss": loss, "tokens": result["tokens"],
                        "bytes_per_worker": result["diloco_bytes_per_worker"]} for m, loss in in_memory_modes.items()]
    for row in result["rows"]:
        row["vs_ddp"] = f"{row['eval_loss'] / ddp_loss - 1:+.1%}"
        row["ddp_bytes_ratio"] = f"{result['ddp_bytes_per_worker'] / row['bytes_per_worker']:.0f}x" if row["bytes_per_worker"] else "-"
    _plot(curves, Path(args.out) / "convergence.png", k, H)
    return result


def _plot(curves, path: Path, k: int, H: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: pip install -e .[bench] for the plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"diloco": f"DiLoCo fp32, {k} workers, H={H}", "ddp": f"data-parallel, {k} workers",
              "single": "one worker", "diloco_eager": "DiLoCo fp32, eager overlap",
              "diloco_delayed": "DiLoCo fp32, delayed overlap"}
    for name, points in curves.items():
        ax.plot([t / 1e6 for t, _ in points], [l for _, l in points], marker=".", label=labels.get(name, name))
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("held-out eval loss")
    ax.set_title("Convergence at equal tokens (tiny model, in-process)")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
