"""Chaos run: a local swarm whose peers are killed and restarted at random.

Starts N real gonka-node processes on loopback. For the given duration it
picks a random live peer every ~interval seconds (exponentially distributed),
kills it with SIGKILL or SIGTERM, and restarts it in the same directory (same
peer id, resuming from its checkpoint, bootstrapping from a live peer). At the
end it waits for the swarm to settle, stops everyone, and reports:

- rounds committed vs round attempts (a group that formed and started averaging);
- the longest time any live peer went without committing (and the bound);
- whether all live peers end with the same round and params_hash.

Writes DIR/chaos.json and the logs of every incarnation of every peer.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localswarm import LocalNode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Timings of the chaos swarm, and the bound on a survivor's wait they imply
# (docs/faults.md): round_timeout + max(3 heartbeats, request_timeout)
# + round_timeout, plus one round of inner steps.
HEARTBEAT, REQUEST, ROUND, GATHER = 1.0, 5.0, 20.0, 20.0
BOUND = ROUND + max(3 * HEARTBEAT, REQUEST) + ROUND


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=5)
    p.add_argument("--duration", type=float, default=600, help="seconds of faults (default 600)")
    p.add_argument("--interval", type=float, default=30, help="mean seconds between faults (default 30)")
    p.add_argument("--signals", default="KILL,TERM", help="signals to use, comma-separated (default KILL,TERM)")
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--out", default="", help="output directory (default runs/chaos-<time>)")
    a = p.parse_args()
    if a.peers < 3 or a.duration <= 0 or a.interval <= 0 or a.inner_steps < 1:
        p.error("need --peers >= 3 and positive --duration, --interval, --inner-steps")
    try:
        a.signals = [getattr(signal, f"SIG{s.strip().upper()}") for s in a.signals.split(",")]
    except AttributeError:
        p.error(f"unknown signal in --signals {a.signals!r}")
    return a


class Chaos:
    def __init__(self, args: argparse.Namespace, out: Path):
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.incarnations: dict[int, list[LocalNode]] = {i: [] for i in range(args.peers)}
        self.faults: list[dict] = []
        self.t0 = time.time()
        self.node_args = [
            "--run-id", "chaos", "--model", "tiny", "--inner-steps", str(args.inner_steps), "--threads", "1",
            "--min-peers", "2", "--metrics-addr", "off",
            "--set", f"swarm.heartbeat_interval={HEARTBEAT}", "--set", f"swarm.request_timeout={REQUEST}",
            "--set", f"swarm.round_timeout={ROUND}", "--set", f"swarm.gather_timeout={GATHER}",
            "--set", "data.batch_size=4", "--set", "data.seq_len=64",
        ]

    def current(self, i: int) -> LocalNode | None:
        runs = self.incarnations[i]
        return runs[-1] if runs and runs[-1].alive() else None

    def start(self, i: int, bootstrap: str | None) -> LocalNode:
        k = len(self.incarnations[i])
        args = [*self.node_args, "--checkpoint-dir", str(self.out / f"peer{i}" / "checkpoints")]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        node = LocalNode(self.out / f"peer{i}", args, log_name=f"node-{k}.log")
        self.incarnations[i].append(node)
        return node

    def live_address(self, exclude: int) -> str | None:
        for j in self.rng.sample(range(self.args.peers), self.args.peers):
            node = self.current(j)
            if j != exclude and node is not None:
                addr = node.address(timeout=0.5)
                if addr:
                    return addr
        return None

    def run(self) -> dict:
        first = self.start(0, None)
        addr = first.address(timeout=120)
        if addr is None:
            raise SystemExit(f"first peer did not start:\n{first.log()[-2000:]}")
        for i in range(1, self.args.peers):
            self.start(i, addr)
        print(f"chaos: {self.args.peers} peers up, faults every ~{self.args.interval:.0f}s for {self.args.duration:.0f}s")
        end = time.time() + self.args.duration
        while time.time() < end:
            time.sleep(min(max(1.0, self.rng.expovariate(1 / self.args.interval)), max(0.0, end - time.time())))
            if time.time() >= end:
                break
            self.fault()
        settled = self.settle(timeout=90)
        for i in range(self.args.peers):
            if self.current(i) is not None:
                self.current(i).stop(signal.SIGTERM)
        return self.report(settled)

    def fault(self) -> None:
        live = [i for i in range(self.args.peers) if self.current(i) is not None]
        victim = self.rng.choice(live)
        sig = self.rng.choice(self.args.signals)
        node = self.current(victim)
        t = time.time() - self.t0
        code = node.stop(sig, timeout=60)
        print(f"  t={t:6.1f}s  {signal.Signals(sig).name:7s} peer{victim} (exit {code}); restarting")
        self.faults.append({"t": round(t, 1), "peer": victim, "signal": signal.Signals(sig).name, "exit": code})
        for attempt in range(5):
            node = self.start(victim, self.live_address(exclude=victim))
            if node.address(timeout=60):
                return
            node.stop(signal.SIGKILL)
            time.sleep(2 * (attempt + 1))
        print(f"  peer{victim} failed to restart", file=sys.stderr)

    def settle(self, timeout: float) -> dict | None:
        """Wait until every live peer reports the same (round, params_hash); return that state."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = [n.live_status() for n in (self.current(i) for i in range(self.args.peers)) if n]
            keys = {(s["round"], s["params_hash"]) for s in states if s}
            if len(keys) == 1 and all(states) and len(states) == self.args.peers:
                round_, h = keys.pop()
                return {"round": round_, "params_hash": h, "peers": len(states)}
            time.sleep(0.2)
        return None

    def report(self, settled: dict | None) -> dict:
        committed_groups, attempted_groups, commit_rounds = set(), set(), set()
        max_gap, max_join = 0.0, 0.0
        for runs in self.incarnations.values():
            for node in runs:
                text = node.log()
                committed_groups |= set(re.findall(r"committed round=\d+ .* group=(\w+)", text))
                attempted_groups |= set(re.findall(r"group=(\w+)", text))
                commit_rounds |= {int(r) for r in re.findall(r"committed round=(\d+)", text)}
                times = [t for t, _, _, _ in node.events()]
                if times:
                    max_join = max(max_join, times[0] - node.started)
                    max_gap = max([max_gap] + [b - a for a, b in zip(times, times[1:])])
        result = {
            "peers": self.args.peers,
            "duration_s": self.args.duration,
            "fault_interval_s": self.args.interval,
            "faults": self.faults,
            "rounds_committed": len(commit_rounds),
            "round_attempts": len(attempted_groups),
            "attempts_committed": len(committed_groups),
            "committed_fraction": round(len(committed_groups) / max(1, len(attempted_groups)), 4),
            "max_wait_without_commit_s": round(max_gap, 2),
            "max_restart_to_first_commit_s": round(max_join, 2),
            "bound_s": BOUND,
            "final": settled,
            "final_consistent": settled is not None,
        }
        (self.out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
        return result


def main() -> int:
    args = parse_args()
    out = Path(args.out or ROOT / "runs" / time.strftime("chaos-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(args, out)
    try:
        r = chaos.run()
    finally:
        for runs in chaos.incarnations.values():
            for node in runs:
                if node.alive():
                    node.stop(signal.SIGKILL, timeout=10)
    print(f"\nfaults injected          {len(r['faults'])}")
    print(f"rounds committed         {r['rounds_committed']}")
    print(f"round attempts           {r['round_attempts']} ({r['attempts_committed']} committed, "
          f"{100 * r['committed_fraction']:.1f}%)")
    print(f"longest wait w/o commit  {r['max_wait_without_commit_s']:.1f}s (bound {r['bound_s']:.0f}s + one round)")
    print(f"restart to first commit  {r['max_restart_to_first_commit_s']:.1f}s (longest)")
    print(f"final state              {'consistent: ' + json.dumps(r['final']) if r['final_consistent'] else 'INCONSISTENT'}")
    print(f"details in {out / 'chaos.json'}")
    return 0 if r["final_consistent"] else 1


if __name__ == "__main__":
    sys.exit(main())
