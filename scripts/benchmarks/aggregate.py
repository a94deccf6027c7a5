"""Benchmark ``aggregate``: what each ``swarm.aggregator`` costs in quality and time.

(a) Quality with no attacker: the in-process simulator (k = 5 workers, the tiny model, the
    convergence benchmark's inner and outer settings) averaging through the swarm's own part
    owner code (``p2p.compression.SwarmAverage``) with each aggregator, same seed; held-out eval
    loss after R rounds, and each robust aggregator's loss relative to the mean's (goal: within
    0.5%).
(b) One hostile member among the 5 (the last in member order), sending each round in place of
    its pseudo-gradient: every value ±1e30 or ±3.4e38 against the honest sign (``fill:``), or
    10^4 or -10 times its honest pseudo-gradient (``scale:``), with its honest token weight (the
    swarm caps weights). Honest eval loss per aggregator; a run whose eval loss leaves the finite
    range or exceeds ``DIVERGED_LOSS`` stops there and reports the round.
(c) Cost per piece: one piece of 2^18 values from 5 members, each aggregator's median time over
    several repeats against the plain mean's (same inputs; torch limited to --threads).

Other load on the machine slows torch ops a lot; the JSON keeps the load average before and after.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from p2p.aggregate import AGGREGATE
from p2p.compression import PIECE_ELEMS, SwarmAverage
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import load_corpus
from trainer.determinism import seeded_normal_
from trainer.simulator import Simulator

from .convergence import INNER_LR, OUTER_LR, OUTER_MOMENTUM
from .options import positive_int

ATTACKS = ("fill:1e30", "fill:3.4e38", "scale:1e4", "scale:-10")
SMOKE_ATTACKS = ("fill:3.4e38", "scale:-10")  # one of each kind
# An untrained tiny model scores about 5.5: far above it the model is wrecked.
DIVERGED_LOSS = 20.0
GOAL_CLEAN_RATIO = 1.005
COLUMNS = ["attack", "aggregator", "eval_loss", "vs_mean_clean", "rounds_run", "diverged", "seconds"]


def add_arguments(group) -> None:
    group.add_argument("--workers", type=positive_int,
                       help="k workers, one of them hostile in (b) (default 5; 3 with --smoke)")
    group.add_argument("--inner-steps", type=positive_int, help="H (default 20; 5 with --quick, 1 with --smoke)")
    group.add_argument("--rounds", type=positive_int, help="outer rounds (default 8; 3 with --quick, 1 with --smoke)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--aggregators", default=",".join(AGGREGATE),
                       help=f"comma-separated aggregators (default {','.join(AGGREGATE)})")
    group.add_argument("--attacks",
                       help=f"comma-separated attacks for (b), 'none' for none (default {','.join(ATTACKS)}; "
                            f"{','.join(SMOKE_ATTACKS)} with --smoke)")
    group.add_argument("--repeats", type=positive_int,
                       help="timed repeats per aggregator in (c) (default 21; 5 with --quick, 2 with --smoke)")
    group.add_argument("--threads", type=positive_int, default=1,
                       help="torch CPU threads (default 1: on shared cores extra threads wait for each other)")


def _defaults(args) -> None:
    smoke = getattr(args, "smoke", False)
    args.workers = args.workers or (3 if smoke else 5)
    args.inner_steps = args.inner_steps or (1 if smoke else 5 if args.quick else 20)
    args.rounds = args.rounds or (1 if smoke else 3 if args.quick else 8)
    args.repeats = args.repeats or (2 if smoke else 5 if args.quick else 21)
    args.attacks = args.attacks or ",".join(SMOKE_ATTACKS if smoke else ATTACKS)
    args.aggregator_names = [a for a in args.aggregators.split(",") if a]
    bad = [a for a in args.aggregator_names if a not in AGGREGATE]
    if bad or "mean" not in args.aggregator_names:
        raise SystemExit(f"aggregate: --aggregators needs mean and names from {', '.join(AGGREGATE)} (got {args.aggregators!r})")
    args.attack_names = [] if args.attacks.strip() == "none" else [a for a in args.attacks.split(",") if a]
    if args.workers < 2 and args.attack_names:
        raise SystemExit("aggregate: an attack needs --workers >= 2")


def _simulate(args, corpus, aggregator: str, hostile: str | None) -> dict:
    H, R = args.inner_steps, args.rounds
    data = DataConfig(batch_size=4, seq_len=64)
    inner = InnerConfig(steps=H, lr=INNER_LR, warmup_steps=min(100, H * R // 10), total_steps=H * R)
    sim = Simulator(args.workers, model=ModelConfig(source="tiny"), data=data, inner=inner,
                    outer=OuterConfig(lr=OUTER_LR, momentum=OUTER_MOMENTUM), corpus=corpus, seed=args.seed,
                    combine=SwarmAverage(aggregator), hostile=None if hostile is None else (args.workers - 1, hostile))
    started = time.perf_counter()
    losses, diverged = [], None
    for r in range(R):
        loss = sim.run_sync(1, H)[0]["eval_loss"]
        losses.append(loss if math.isfinite(loss) else None)
        if not math.isfinite(loss) or loss > DIVERGED_LOSS:
            diverged = r + 1
            break
    seconds = time.perf_counter() - started
    final = losses[-1]
    print(f"  {hostile or 'none'} / {aggregator}: eval loss {final if final is None else round(final, 4)}"
          f"{f' (diverged in round {diverged})' if diverged else ''} ({seconds:.0f}s)", flush=True)
    return {"attack": hostile or "none", "aggregator": aggregator, "eval_loss": final, "rounds_run": len(losses),
            "diverged": diverged is not None, "diverged_round": diverged, "losses": losses, "seconds": seconds}


def _cost(names: list[str], repeats: int, members: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    xs = [seeded_normal_(torch.empty(PIECE_ELEMS), 1e-3, gen) for _ in range(members)]
    weights = [float(1000 + 100 * i) for i in range(members)]
    seconds = {}
    for name in names:
        fn = AGGREGATE[name]
        fn(weights, xs)  # warm-up: buffers, allocator
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(weights, xs)
            times.append(time.perf_counter() - t0)
        seconds[name] = times
    base = statistics.median(seconds["mean"])
    return [{"aggregator": n, "piece_ms": statistics.median(t) * 1e3, "best_ms": min(t) * 1e3,
             "vs_mean": statistics.median(t) / base, "all_ms": [s * 1e3 for s in t]} for n, t in seconds.items()]


def run(args: argparse.Namespace) -> dict:
    _defaults(args)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    corpus = load_corpus([])
    names = args.aggregator_names
    rows = [_simulate(args, corpus, name, None) for name in names]
    clean = {r["aggregator"]: r["eval_loss"] for r in rows}
    for attack in args.attack_names:
        rows += [_simulate(args, corpus, name, attack) for name in names]
    for row in rows:
        loss, ref = row["eval_loss"], clean["mean"]
        row["vs_mean_clean"] = f"{loss / ref - 1:+.2%}" if loss is not None and ref else "-"
    cost = _cost(names, args.repeats, args.workers)
    within = {n: clean[n] is not None and clean[n] <= GOAL_CLEAN_RATIO * clean["mean"] for n in names if n != "mean"}
    cost_line = ", ".join(f"{c['aggregator']} {c['piece_ms']:.2f} ms ({c['vs_mean']:.1f}x)" for c in cost)
    return {
        "workers": args.workers,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "seed": args.seed,
        "hostile_member": args.workers - 1,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "clean_eval_loss": clean,
        "targets": {f"{n}_clean_within_0.5pct_of_mean": ok for n, ok in within.items()},
        "cost_per_piece": cost,
        "columns": COLUMNS,
        "rows": rows,
        "notes": [f"(c) one piece of {PIECE_ELEMS:,} values from {args.workers} members, median of {args.repeats}, "
                  f"{torch.get_num_threads()} torch thread(s): {cost_line}",
                  f"load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}"],
    }
