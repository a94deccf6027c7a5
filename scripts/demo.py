"""A local swarm on loopback: N real `gonka-node start` processes training one model.

The first node starts a new swarm; the others bootstrap from its address. The
demo prints every node's progress after each round and ends with the loss and
every peer's params_hash (equal on all of them, or the demo fails).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).with_name("gonka-node")


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
    workdir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.peers)
    procs: list[subprocess.Popen] = []

    def start(i: int, bootstrap: str | None) -> subprocess.Popen:
        d = workdir / f"peer{i}"
        d.mkdir(exist_ok=True)
        cmd = [str(BIN), "start", "--run-id", "demo", "--model", args.model, "--inner-steps", str(args.inner_steps),
               "--max-rounds", str(args.rounds), "--min-peers", str(args.peers), "--threads", str(threads),
               "--metrics-addr", f"127.0.0.1:{9400 + i}", "--control", str(d / "control.sock"),
               "--status-file", str(d / "status.json"), "--checkpoint-dir", str(d / "checkpoints"),
               "--identity", str(d / "identity.key"), "--listen", "/ip4/127.0.0.1/tcp/0"]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        log = open(d / "node.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(proc)
        return proc

    def status(i: int) -> dict:
        try:
            return json.loads((workdir / f"peer{i}" / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def stop_all(sig=signal.SIGTERM) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    deadline = time.monotonic() + args.timeout
    print(f"demo: {args.peers} peers, model {args.model}, {args.rounds} rounds of {args.inner_steps} inner steps")
    print(f"demo: logs and checkpoints in {workdir}")
    try:
        start(0, None)
        log0 = workdir / "peer0" / "node.log"
        addr = None
        while addr is None:
            if time.monotonic() > deadline or procs[0].poll() is not None:
                print(log0.read_text(errors="replace")[-2000:], file=sys.stderr)
                return 1
            m = re.search(r"^listening on (\S+)", log0.read_text(errors="replace"), re.M)
            addr = m.group(1) if m else None
            time.sleep(0.1)
        print(f"demo: swarm started, bootstrap address {addr}")
        for i in range(1, args.peers):
            start(i, addr)
        shown = 0
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                print("demo: timed out", file=sys.stderr)
                stop_all()
                return 1
            rounds = [status(i).get("round", 0) for i in range(args.peers)]
            if min(rounds) > shown:
                shown = min(rounds)
                row = "  ".join(f"peer{i} loss={status(i).get('loss') or float('nan'):.3f}" for i in range(args.peers))
                print(f"round {shown}/{args.rounds}: {row}", flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        return 130
    finally:
        stop_all()

    finals = [status(i) for i in range(args.peers)]
    print("\nfinal state:")
    for i, s in enumerate(finals):
        print(f"  peer{i} {s.get('peer_id', '?')[-12:]}  round={s.get('round')}  loss={s.get('loss') or float('nan'):.4f}"
              f"  eval_loss={s.get('eval_loss') or float('nan'):.4f}  params_hash={s.get('params_hash')}")
    codes = [p.returncode for p in procs]
    same = len({s.get("params_hash") for s in finals}) == 1 and all(s.get("round") == args.rounds for s in finals)
    print("all peers hold identical parameters" if same else "peers DIFFER", f"(exit codes {codes})")
    return 0 if same and codes == [0] * len(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
