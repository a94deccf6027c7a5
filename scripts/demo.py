"""A local swarm on loopback: N real `gonka-node start` processes training one model.

The first node starts a new swarm; the others bootstrap from its address. The
demo prints every node's progress after each round and ends with the loss and
every peer's params_hash (equal on all of them, or the demo fails).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localswarm import LocalNode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=3, help="number of nodes (default 3)")
    p.add_argument("--rounds", type=int, default=5, help="outer rounds to train (default 5)")
    p.add_argument("--inner-steps", type=int, default=20, help="inner AdamW steps per round (default 20)")
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument("--workdir", default="", help="where logs, checkpoints and status files go (default runs/demo-<time>)")
    p.add_argument("--timeout", type=float, default=900, help="give up after this many seconds (default 900)")
    args = p.parse_args()
    if args.peers < 1 or args.rounds < 1 or args.inner_steps < 1:
        p.error("--peers, --rounds and --inner-steps must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    workdir = Path(args.workdir or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S"))
    threads = max(1, (os.cpu_count() or 1) // args.peers)
    common = ["--run-id", "demo", "--model", args.model, "--inner-steps", str(args.inner_steps),
              "--max-rounds", str(args.rounds), "--min-peers", str(args.peers), "--threads", str(threads)]

    def node_args(i: int) -> list[str]:
        return [*common, "--metrics-addr", f"127.0.0.1:{9400 + i}",
                "--checkpoint-dir", str(workdir / f"peer{i}" / "checkpoints")]

    print(f"demo: {args.peers} peers, model {args.model}, {args.rounds} rounds of {args.inner_steps} inner steps")
    print(f"demo: logs, checkpoints and status files in {workdir}")
    nodes = [LocalNode(workdir / "peer0", node_args(0))]
    try:
        addr = nodes[0].address(timeout=120)
        if addr is None:
            print(nodes[0].log()[-2000:], file=sys.stderr)
            return 1
        print(f"demo: swarm started, bootstrap address {addr}")
        nodes += [LocalNode(workdir / f"peer{i}", [*node_args(i), "--bootstrap", addr]) for i in range(1, args.peers)]
        deadline, shown = time.monotonic() + args.timeout, 0
        while any(n.alive() for n in nodes):
            if time.monotonic() > deadline:
                print("demo: timed out", file=sys.stderr)
                return 1
            statuses = [n.status() for n in nodes]
            if min(s.get("round", 0) for s in statuses) > shown:
                shown = min(s.get("round", 0) for s in statuses)
                row = "  ".join(f"peer{i} loss={s.get('loss') or float('nan'):.3f}" for i, s in enumerate(statuses))
                print(f"round {shown}/{args.rounds}: {row}", flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        return 130
    finally:
        codes = [n.stop(signal.SIGTERM) for n in nodes]

    finals = [n.status() for n in nodes]
    print("\nfinal state:")
    for i, s in enumerate(finals):
        print(f"  peer{i} {s.get('peer_id', '?')[-12:]}  round={s.get('round')}  loss={s.get('loss') or float('nan'):.4f}"
              f"  eval_loss={s.get('eval_loss') or float('nan'):.4f}  params_hash={s.get('params_hash')}")
    same = len({s.get("params_hash") for s in finals}) == 1 and all(s.get("round") == args.rounds for s in finals)
    print("all peers hold identical parameters" if same else "peers DIFFER", f"(exit codes {codes})")
    return 0 if same and codes == [0] * len(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
