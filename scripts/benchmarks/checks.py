"""Benchmark ``checks``: what a check of a member's update tells, round by round, and what it costs.

In process, the node's own code: workers (trainer/diloco.py) draw their assigned data by one run
key (trainer/data.py), train a round, and the round's average of the honest members' updates
(weighted by tokens) is every worker's outer step. Before it, every member's update is checked
by two honest checkers, as a node checks a sampled member (trainer/check.py ``yardstick`` and
``check_gains``, the verdict p2p/checks.py ``judge``; a check fails when both checkers flag it).

Members: honest fast hosts, honest slow hosts (half the inner steps), and one of each kind a
check is for, claiming a fast host's tokens: ``shirk`` (trains on another stream than its
own), ``replay`` (trains, sends its previous round's update), ``free_ride`` (sends zeros) and
``noise`` (random values with the norm of a fast host's update). The liars' updates are not in
the average (a node's Gram scores leave zeros and noise out; the figures are about checks).

Rows: per kind, checks run, judged (the checker's own advantage showed what it tests), failed
(both checkers flagged), the first round one failed, and failures among judged checks. The
result keeps every round's verdicts, and the cost: a check's and the round's yardstick's
seconds against a fast host's inner steps of the round (the checks a node runs a round, with
``swarm.checked_members`` = 2 and 2 checkers each over the members, on average).

Published figures: docs/ledger.md (``python scripts/bench.py checks``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import torch

from p2p.checks import CHECK_WINDOWS, CHECKED, CHECKERS, judge, judged
from trainer.check import check_gains, control_windows, trained_windows, yardstick
from trainer.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from trainer.data import load_corpus
from trainer.diloco import DiLoCoWorker

from .options import positive_int

KINDS = ("fast", "slow", "shirk", "replay", "free_ride", "noise")
COLUMNS = ["kind", "members", "checks", "judged", "failed", "first_failed", "failed_of_judged"]


def add_arguments(group) -> None:
    group.add_argument("--rounds", type=positive_int, help="outer rounds (default 16; 3 with --smoke)")
    group.add_argument("--inner-steps", type=positive_int, help="H of a fast host (default 30; 2 with --smoke)")
    group.add_argument("--fast", type=positive_int, default=3, help="honest fast hosts (at least 3: the checkers)")
    group.add_argument("--slow", type=positive_int, default=2, help="honest hosts at half the inner steps")
    group.add_argument("--windows", type=positive_int, help=f"windows of each kind a check evaluates "
                                                            f"(default {CHECK_WINDOWS}; 4 with --smoke)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")


def _flat(worker: DiLoCoWorker) -> torch.Tensor:
    return torch.cat([d.reshape(-1) for d in worker.pseudo_gradient()]).clone()


def run(args: argparse.Namespace) -> dict:
    smoke = getattr(args, "smoke", False)
    rounds = args.rounds or (3 if smoke else 16)
    steps = args.inner_steps or (2 if smoke else 30)
    windows = args.windows or (4 if smoke else CHECK_WINDOWS)
    if args.fast < 3:
        raise SystemExit("--fast: need at least 3 honest fast hosts (each member has 2 checkers)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    load_before = os.getloadavg()
    data = DataConfig(batch_size=4, seq_len=64)
    corpus = load_corpus([])
    names = ([f"fast{i}" for i in range(args.fast)] + [f"slow{i}" for i in range(args.slow)]
             + ["shirk", "replay", "free_ride", "noise"])
    kind = {n: n.rstrip("0123456789") for n in names}
    trains = [n for n in names if kind[n] in ("fast", "slow", "shirk", "replay")]
    workers = {n: DiLoCoWorker(model=ModelConfig(source="tiny"), data=data, inner=InnerConfig(steps=steps),
                               outer=OuterConfig(), corpus=corpus, shard_key=n, seed=args.seed) for n in trains}
    for w in workers.values():
        w.assign_data(f"bench-checks-{args.seed}")
    workers["shirk"].sampler.shard_key = "shirk/elsewhere"  # trains on another stream than its own
    h = {n: steps // 2 if kind[n] == "slow" else steps for n in names}  # inner steps; liars claim a fast host's
    tokens = {n: h[n] * data.batch_size * data.seq_len for n in names}
    checkers = [n for n in names if kind[n] == "fast"]
    verdicts: dict[str, list] = {n: [] for n in names}
    check_s, yard_s, train_s, previous = [], [], [], None
    for rnd in range(1, rounds + 1):
        updates, started = {}, time.perf_counter()
        for n, w in workers.items():
            w.train_for(rnd)
            t0 = time.perf_counter()
            w.inner_steps(h[n])
            if n == checkers[0]:
                train_s.append(time.perf_counter() - t0)
            updates[n] = _flat(w)
        replayed = updates["replay"]
        updates["replay"] = previous if previous is not None else replayed
        previous = replayed
        updates["free_ride"] = torch.zeros_like(updates[checkers[0]])
        gen = torch.Generator().manual_seed(args.seed * 1000 + rnd)
        noise = torch.randn(updates[checkers[0]].numel(), generator=gen)
        updates["noise"] = noise * (updates[checkers[0]].norm() / noise.norm())
        # Checks before the outer step: θ is still the round's start.
        beacon = hashlib.sha256(f"bench-checks/{args.seed}/{rnd}".encode()).digest()
        for i, c in enumerate(checkers):
            worker = workers[c]
            mine = [m for m in names if m != c and (c in _checkers_of(m, checkers))]
            control = control_windows(worker.sampler, beacon, rnd, windows)
            own = trained_windows(worker.sampler, c, rnd, tokens[c], data.seq_len, windows)
            assigned = {m: trained_windows(worker.sampler, m, rnd, tokens[m], data.seq_len, windows) for m in mine}
            t0 = time.perf_counter()
            shared = yardstick(worker, updates[c], own, control, assigned)
            yard_s.append(time.perf_counter() - t0)
            for m in mine:
                t0 = time.perf_counter()
                gains = check_gains(worker, m, updates[m], assigned[m], own, control, shared)
                check_s.append(time.perf_counter() - t0)
                verdicts[m].append((rnd, c, judge(gains), judged(gains)))
        honest = [n for n in names if kind[n] in ("fast", "slow")]
        weight = sum(tokens[n] for n in honest)
        avg = sum(updates[n] * (tokens[n] / weight) for n in honest)
        for w in workers.values():
            w.apply_outer([t.view_as(g).clone() for t, g in zip(torch.split(avg, [g.numel() for g in w.global_params]),
                                                              w.global_params)])
        print(f"round {rnd}: eval {workers[checkers[0]].eval_loss():.4f} "
              f"({time.perf_counter() - started:.1f}s)", flush=True)
    rows = [_row(k, [n for n in names if kind[n] == k], verdicts) for k in KINDS]
    per_check, per_round, train = (statistics.median(x) for x in (check_s, yard_s, train_s))
    # A node's share: CHECKED members checked by CHECKERS each, over the round's members. A check
    # is 3 sets of windows; the yardstick 3 once a round plus 1 per member checked (here every
    # checker checks several: its per-set time is a third of a check's).
    checks_per_peer = CHECKED * CHECKERS / len(names)
    per_set = per_check / 3
    cost = checks_per_peer * 4 * per_set + min(1.0, checks_per_peer) * 3 * per_set
    return {
        "rounds": rounds, "inner_steps": steps, "windows": windows, "seed": args.seed, "members": len(names),
        "torch_threads": torch.get_num_threads(), "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "check_seconds": per_check, "yardstick_seconds": per_round, "fast_round_train_seconds": train,
        "checks_per_peer_round": checks_per_peer, "check_cost_vs_training": cost / train,
        "verdicts": {n: [[r, c[-6:], list(f), j] for r, c, f, j in v] for n, v in verdicts.items()},
        "columns": COLUMNS, "rows": rows,
        "check_seconds_per_peer_round": cost,
        "notes": [f"a check {per_check:.3f}s ({windows} windows x 3), a fast host's {steps} inner steps "
                  f"{train:.3f}s: at {checks_per_peer:.2f} checks per peer a round (and its share of a "
                  f"yardstick) {cost:.3f}s, {cost / train:.1%} of its training time",
                  f"load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}"],
    }


def _checkers_of(member: str, checkers: list[str]) -> list[str]:
    """The CHECKERS fast hosts after ``member`` in a ring of the fast hosts (any other member:
    the first CHECKERS)."""
    if member not in checkers:
        return checkers[:CHECKERS]
    i = checkers.index(member)
    return [checkers[(i + 1 + j) % len(checkers)] for j in range(CHECKERS)]


def _row(kind: str, members: list[str], verdicts: dict[str, list]) -> dict:
    by_round: dict[tuple[str, int], list] = {}
    for m in members:
        for rnd, _, flags, judged in verdicts[m]:
            by_round.setdefault((m, rnd), []).append((flags, judged))
    failed = sorted(rnd for (m, rnd), v in by_round.items() if len(v) == CHECKERS and all(f for f, _ in v))
    judged = [k for k, v in by_round.items() if any(j for _, j in v)]
    return {"kind": kind, "members": len(members), "checks": len(by_round), "judged": len(judged),
            "failed": len(failed), "first_failed": failed[0] if failed else "-",
            "failed_of_judged": f"{len(failed) / len(judged):.0%}" if judged else "-"}
