"""Benchmark `sweep`: outer learning rate, momentum and codec settings of DiLoCo, side by side.

Each run is the in-process simulator (the code a swarm peer runs) on the tiny Llama
preset: k workers, H inner steps a round, the same total inner steps per worker
(``--total-steps``, so every run sees the same tokens), the same seed and data;
only the outer step and the codec differ. A run (``--runs``) is given as ``CODEC@LR,MOMENTUM[,DECAY]``:

- ``CODEC``: ``fp32`` (exact) or any ``swarm.codec`` (int8, fp4, sparse, sparse-k128, ...),
  with error feedback, through the swarm's own encode/average/re-encode functions
  (``p2p.compression.CompressingMember``);
- ``LR``, ``MOMENTUM``: the outer step (Nesterov when MOMENTUM > 0, plain SGD at 0);
- ``DECAY``: error feedback's decay (``swarm.error_feedback_decay``, default 1): with
  MOMENTUM 0 this is SparseLoCo's outer step, the decayed residual in the role of the
  momentum.

Any number field may list alternatives with ``|``: ``fp32@0.4|0.7|1.0,0.8|0.9`` is six
runs. Data-parallel training (gradients averaged every step, same tokens) is the
baseline of ``vs_ddp``. ``bytes_each_way``: what a worker sends (and receives) per round
in the butterfly all-reduce (``wire_ratios``); ``x_fp32``: fp32's bytes over the run's.
Every finished run is appended to ``OUT/sweep.jsonl`` as it ends.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

DEFAULT_SPECS = ["fp32@0.7,0.9", "fp4@0.7,0.9", "sparse@1.0,0,0.95"]


def add_arguments(group) -> None:
    group.add_argument("--runs", dest="specs", nargs="+", default=[], help=f"runs, CODEC@LR,MOMENTUM[,DECAY] (default: {' '.join(DEFAULT_SPECS)})")
    group.add_argument("--workers", type=int, default=0, help="k workers (default 4; 2 with --smoke)")
    group.add_argument("--inner-steps", type=int, default=0, help="H (default 30; 2 with --smoke)")
    group.add_argument("--total-steps", type=int, default=0,
                       help="inner steps per worker in all (default 1050; 4 with --smoke); rounds = this / H")
    group.add_argument("--batch-size", type=int, default=4, help="sequences per worker step (default 4)")
    group.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    group.add_argument("--inner-lr", type=float, default=1e-3, help="peak AdamW lr of every run (default 1e-3)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--model", default="tiny", help="model preset (default tiny)")
    group.add_argument("--no-ddp", action="store_true", help="skip the data-parallel baseline")
    group.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def expand(spec: str) -> list[tuple[str, float, float, float]]:
    """``CODEC@LR,MOMENTUM[,DECAY]`` with ``|`` alternatives -> (codec, lr, momentum, decay) runs."""
    try:
        codec, numbers = spec.split("@", 1)
        fields = numbers.split(",")
        if len(fields) not in (2, 3) or not codec:
            raise ValueError
        choices = [[float(v) for v in f.split("|")] for f in fields] + ([[1.0]] if len(fields) == 2 else [])
    except ValueError:
        raise SystemExit(f"sweep: cannot read run {spec!r} (CODEC@LR,MOMENTUM[,DECAY], alternatives with |)") from None
    return [(codec, lr, m, d) for lr, m, d in itertools.product(*choices)]


def wire_ratios(codec, numel: int, k: int) -> tuple[float, int]:
    """(fp32 all-reduce's bytes / the run's, the run's bytes) per worker and round, each way.

    In the butterfly every worker owns a part: it sends its input to the k - 1 other owners
    and its part's average to the k - 1 other members, and receives as much, so up and down
    are both (k - 1)/k x (input + average) of the whole vector (2 (k - 1)/k x 4 bytes a value
    in fp32)."""
    from p2p.compression import exchange_bytes

    way = exchange_bytes(codec, numel, k)
    return 2 * 4 * numel * (k - 1) / k / way, int(way)


def run(args: argparse.Namespace) -> dict:
    from p2p.codecs import get_codec
    from p2p.compression import CompressingMember
    from trainer.baselines import DataParallel
    from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
    from trainer.data import load_corpus
    from trainer.simulator import Simulator

    smoke = getattr(args, "smoke", False)
    k = args.workers or (2 if smoke else 4)
    H = args.inner_steps or (2 if smoke else 30)
    total = args.total_steps or (4 if smoke else 1050)
    rounds = total // H
    if min(k, H, rounds, args.batch_size, args.seq_len, args.threads) < 1:
        raise SystemExit("sweep: --workers, --inner-steps, --batch-size, --seq-len, --threads >= 1 and --total-steps >= H")
    specs = args.specs or (["fp32@1.0,0.5", "sparse@1.0,0,0.9"] if smoke else DEFAULT_SPECS)
    runs = [r for spec in specs for r in expand(spec)]
    for codec, lr, momentum, decay in runs:
        try:
            get_codec(codec)
            OuterConfig(lr=lr, momentum=momentum)
        except ValueError as e:
            raise SystemExit(f"sweep: {e}") from None
        if not 0 < decay <= 1:
            raise SystemExit(f"sweep: decay must be in (0, 1] (got {decay})")
    torch.set_num_threads(args.threads)
    steps = H * rounds
    model, data = ModelConfig(source=args.model), DataConfig(batch_size=args.batch_size, seq_len=args.seq_len)
    inner = InnerConfig(steps=H, lr=args.inner_lr, warmup_steps=min(100, steps // 10), total_steps=steps)
    corpus = load_corpus([])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "sweep.jsonl"
    setting = {"workers": k, "inner_steps": H, "rounds": rounds, "batch_size": args.batch_size, "seq_len": args.seq_len,
               "model": args.model, "seed": args.seed, "inner_lr": args.inner_lr}

    ddp_loss = None
    if not args.no_ddp:
        started = time.perf_counter()
        ddp = DataParallel(k, model=model, data=data, inner=inner, corpus=corpus, seed=args.seed)
        ddp.train(steps)
        ddp_loss = ddp.eval_loss()
        print(f"  ddp: eval loss {ddp_loss:.4f} ({time.perf_counter() - started:.0f}s)", flush=True)

    rows = []
    for codec_name, lr, momentum, decay in runs:
        codec = get_codec(codec_name)
        exact = codec.exact
        outer = OuterConfig(lr=lr, momentum=momentum, nesterov=momentum > 0)
        wrap = None if exact else (lambda i, m, c=codec, d=decay: CompressingMember(m, c, k, feedback=True, decay=d))
        started = time.perf_counter()
        sim = Simulator(k, model=model, data=data, inner=inner, outer=outer, corpus=corpus, seed=args.seed, wrap=wrap)
        records = sim.run_sync(rounds, H)
        loss = records[-1]["eval_loss"]
        numel = sum(p.numel() for p in sim.workers[0].global_params)
        x_fp32, way = wire_ratios(codec, numel, k)
        row = {"codec": codec.name, "outer_lr": lr, "momentum": momentum, "decay": decay if not exact else 1.0,
               "eval_loss": loss, "vs_ddp": f"{loss / ddp_loss - 1:+.1%}" if ddp_loss else "-",
               "x_fp32": round(x_fp32, 1), "bytes_each_way": way,
               "seconds": round(time.perf_counter() - started, 1)}
        rows.append(row)
        with log.open("a") as f:
            f.write(json.dumps({**setting, **row, "ddp_eval_loss": ddp_loss}) + "\n")
        print(f"  {codec.name} lr {lr} m {momentum} decay {decay}: eval loss {loss:.4f} ({row['seconds']:.0f}s)", flush=True)
    rows.sort(key=lambda r: r["eval_loss"])
    return {**setting, "ddp_eval_loss": ddp_loss, "parameters": numel, "rows": rows,
            "columns": ["codec", "outer_lr", "momentum", "decay", "eval_loss", "vs_ddp", "x_fp32", "seconds"]}
