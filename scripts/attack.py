"""Attack run: a local swarm of honest peers with hostile members, against a clean run.

Starts N honest `gonka-node start` processes on loopback, plus K hostile ones
(``GONKA_TEST_HOSTILE=KIND``, see p2p/hostile.py) whose peer ids sort first, so
they lead every round they are ready for, until every honest peer
holds --rounds committed rounds (or --duration runs out). Before that it runs
the same honest peers (same identities, so the same data shards; same seed and
settings) with no hostile peer: the clean run the attacked one is measured
against. ``--kinds all`` runs one hostile kind after another, each in a fresh
swarm, after one shared clean run. Per scenario it reports:

- rounds committed vs attempted (distinct groups in the honest peers' logs);
- hostile states adopted: an honest peer that re-synced to, or ends on, a state
  the hostile announced or that no honest peer committed (0 is the goal);
- whether the honest peers end on one (round, params_hash), and any round two
  honest peers committed with different hashes;
- the honest eval loss after the same number of rounds as the clean run;
- rejected messages and quarantines by reason, summed over the honest peers'
  /metrics; abort reasons and who quarantined whom (an honest peer
  quarantined by another is a false accusation) from their logs; the longest
  time an honest peer went without committing; errors (a traceback, an ERROR
  line, an early exit) in any peer's log;
- what the ledger says (p2p/ledger.py), from the ledger file of the honest peer
  that holds the most entries (DIR/<scenario>/<peer>/ckpt/ledger.jsonl), or its
  log lines: per hostile peer its credit per claimed token against the honest
  peers', the first round it was flagged, the first round its standing left it
  out, the rounds it was in averages and its flags; the honest peers flagged
  (in the clean run too), and the credit per token of fast vs slow hosts.

``--kinds contributions`` runs the members that lie about their work (free_ride,
noise, replay, overclaim, shirk, and the colluding pair ``copy``); ``--slow K``
runs K of the honest peers at half speed, every peer's round ending on time
(``inner.round_seconds``) with its steps paced (GONKA_TEST_STEP_SECONDS).

Writes DIR/attack.json and the log of every peer (DIR/<scenario>/<peer>/node.log).
This module runs the swarms; scripts/attackreport.py reads what they did and
judges it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attackreport import GOALS, H, compare, print_ledger_table, print_table, scenario_result, short  # noqa: E402
from localswarm import LocalNode  # noqa: E402
from node.control import request  # noqa: E402
from p2p import hostile  # noqa: E402
from p2p.faults import STEP_ENV  # noqa: E402
from p2p.identity import generate_identity, load_or_create_identity, peer_id_from_key  # noqa: E402
from p2p.ledgerfile import FILE_NAME as LEDGER_FILE  # noqa: E402
from trainer.files import atomic_write  # noqa: E402

# The chaos run's timings (docs/faults.md): a stalled or lying peer costs seconds, not minutes.
HEARTBEAT, REQUEST, ROUND, GATHER = 1.0, 5.0, 20.0, 20.0
# A survivor's bound on a wait without a commit after a fault (docs/faults.md), plus
# start-up: a longer wait is reported as a stall.
BOUND = ROUND + max(3 * HEARTBEAT, REQUEST) + ROUND + 30
# One hostile member of each kind p2p/hostile.py knows, with the values of the first trial.
ALL = ("scale=-1000", "fill=1e30", "weight=1e30", "abort", "silent_leader", "alter_slice", "fake_state", "flood")
# With a sparse codec (--codec sparse...), 'all' adds the kinds that use its format's freedom.
SPARSE = ("sparse=pile", "sparse=duplicate", "sparse=max")
# 'contributions': the members that lie about the work their contribution holds (p2p/ledger.py judges them).
CONTRIBUTIONS = ("free_ride", "noise", "replay", "overclaim", "shirk", "copy")
# A kind that is two colluding peers in one swarm; {out} is the run's output directory.
PAIRS = {"copy": ("copy_to={out}/copy", "copy_from={out}/copy")}
# Paced steps (--slow, --step-seconds, --round-seconds): a fast peer's step waits STEP_WAIT, then
# computes for about STEP_COMPUTE seconds; a slow one waits 2 * STEP_WAIT + STEP_COMPUTE, so its
# whole step takes twice a fast one's and it trains half the tokens of a round. STEP_COMPUTE is a
# tiny-preset step (batch 4 x 64, one thread) on the 2-core development machine with 5 to 7 paced
# peers: 0.04 to 0.075 s (2026-12-07, steps waiting 0.05 s took 0.09 to 0.125 s). The wait is
# the larger part, so that how busy the cores are (other peers' averaging, a hostile peer's
# compute or its absence) moves the steps a round holds, and the slow hosts' half, little.
STEP_WAIT, STEP_COMPUTE = 0.2, 0.06


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--honest", type=int, default=5, help="honest peers (default 5)")
    p.add_argument("--hostile", action="append", default=[], metavar="KIND[,KIND...]",
                   help="one hostile peer with these behaviours, e.g. scale=-1000 or fake_state; repeatable: "
                        "all of them join one swarm")
    p.add_argument("--kinds", nargs="+", metavar="KIND",
                   help=f"one swarm per kind, one hostile peer each (two for {', '.join(PAIRS)}: colluders); "
                        f"'all' ({' '.join(ALL)}) and 'contributions' ({' '.join(CONTRIBUTIONS)}) name several")
    p.add_argument("--rounds", type=int, default=20, help="stop once every honest peer holds this round (default 20)")
    p.add_argument("--duration", type=float, default=360, help="at most this many seconds per swarm (default 360)")
    p.add_argument("--inner-steps", type=int, default=10, help="inner steps per round (default 10)")
    p.add_argument("--min-peers", type=int, default=3, help="--min-peers of every peer (default 3)")
    p.add_argument("--slow", type=int, default=0, metavar="K",
                   help="K of the honest peers (the last ones) run at half speed: every peer's steps are paced "
                        "and its rounds end on time (default 0: unpaced, rounds of --inner-steps steps)")
    p.add_argument("--step-seconds", type=float, metavar="S",
                   help=f"paced steps: a fast peer's step waits S seconds first, a slow one's 2 * S + {STEP_COMPUTE} "
                        f"(its compute time) (default {STEP_WAIT} when --slow or --round-seconds is given)")
    p.add_argument("--round-seconds", type=float, metavar="T",
                   help="paced steps: inner.round_seconds of every peer (default: --inner-steps fast steps, "
                        f"--inner-steps * (S + {STEP_COMPUTE}))")
    p.add_argument("--seed", type=int, default=0, help="--seed of every peer (model and data order)")
    p.add_argument("--no-clean", action="store_true", help="skip the clean run (no eval-loss comparison)")
    p.add_argument("--codec", default="fp32", help="swarm.codec of every peer (default fp32); with a sparse codec "
                   f"'--kinds all' adds {' '.join(SPARSE)}")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a further setting of every peer (e.g. outer.momentum=0); repeatable")
    p.add_argument("--out", default="", help="output directory (default runs/attack-<time>)")
    a = p.parse_args()
    try:
        from p2p.codecs import get_codec

        get_codec(a.codec)
    except ValueError as e:
        p.error(f"--codec: {e}")
    if a.honest < 3 or a.rounds < 1 or a.duration <= 0 or a.inner_steps < 1 or a.min_peers < 1:
        p.error("need --honest >= 3 and positive --rounds, --duration, --inner-steps, --min-peers")
    if a.kinds and a.hostile:
        p.error("give either --hostile (one swarm) or --kinds (one swarm per kind)")
    if not 0 <= a.slow < a.honest or (a.step_seconds or 0) < 0 or (a.round_seconds or 0) < 0:
        p.error("need 0 <= --slow < --honest and non-negative --step-seconds, --round-seconds")
    a.paced = bool(a.slow or a.step_seconds is not None or a.round_seconds is not None)
    if a.paced:
        a.step_seconds = STEP_WAIT if a.step_seconds is None else a.step_seconds
        a.slow_step_seconds = round(2 * a.step_seconds + STEP_COMPUTE, 4)
        if a.round_seconds is None:
            a.round_seconds = round(a.inner_steps * (a.step_seconds + STEP_COMPUTE), 2)
    a.out = a.out or str(ROOT / "runs" / time.strftime("attack-%Y%m%d-%H%M%S"))
    named = {"all": [*ALL, *(SPARSE if a.codec.startswith("sparse") else ())], "contributions": CONTRIBUTIONS}
    kinds = [k for kind in a.kinds or () for k in named.get(kind, [kind])]
    # (label, hostile specs): one swarm each.
    a.scenarios = ([(k, [spec.format(out=a.out) for spec in PAIRS.get(k, [k])]) for k in kinds] if kinds
                   else [("+".join(map(short, a.hostile)), a.hostile)] if a.hostile else [])
    if not a.scenarios:
        p.error("name the hostile peers: --hostile KIND (repeatable) or --kinds all")
    for spec in (s for _, sc in a.scenarios for s in sc):
        try:
            if not hostile.parse(spec).any:
                p.error(f"empty hostile kind {spec!r}")
        except ValueError as e:
            p.error(str(e))
    return a


def leading_key(path: Path, below: str) -> None:
    """Create the key file of a hostile peer whose peer id sorts before ``below``: a round's leader
    is its lowest ready peer id (p2p/rounds.py), and ids are cheap to grind, so an attacker leads
    every round it is ready for. Existing files are kept (the same hostile id every scenario)."""
    if path.exists():
        return
    best = generate_identity()
    for _ in range(500):
        if peer_id_from_key(best) < below:
            break
        best = min(best, generate_identity(), key=peer_id_from_key)
    else:
        print(f"  {path.name}: no peer id below {below[:8]} in 500 tries; it leads only some rounds", file=sys.stderr)
    atomic_write(str(path), lambda f: f.write(best), overwrite=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def inherited(env: dict[str, str | None]):
    """The environment a node inherits at start: each of ``env``'s variables set, or (None) absent."""
    old = {var: os.environ.pop(var, None) for var in env}
    os.environ.update({var: value for var, value in env.items() if value})
    try:
        yield
    finally:
        for var, value in old.items():
            os.environ.pop(var, None)
            if value is not None:
                os.environ[var] = value


class Peer:
    """One node of a scenario: its process, identity, metrics port and what was seen of it;
    ``step_seconds``: how long each of its steps waits (paced runs), ``slow``: at half speed."""

    def __init__(self, name: str, key: Path, spec: str | None, step_seconds: float | None = None,
                 slow: bool = False):
        self.name, self.key, self.spec = name, key, spec
        self.step_seconds, self.slow = step_seconds, slow
        self.ledger_file: Path | None = None  # its ledger file, once started
        self.peer_id = load_or_create_identity(str(key))
        self.port = 0  # of its /metrics, picked at each start
        self.node: LocalNode | None = None
        self.metrics = ""  # the last /metrics text scraped
        self.exit: int | None = None
        self.died_at: float | None = None  # seconds into the run, if it exited before the end

    def start(self, directory: Path, node_args: list[str], bootstrap: str | None) -> LocalNode:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.key, directory / "identity.key")  # the same peer id, so the same data shard, every run
        self.port = free_port()
        # Checkpoints only for the ledger file each one rewrites (p2p/ledgerfile.py): a scenario never resumes.
        self.ledger_file = directory / "ckpt" / LEDGER_FILE
        args = [*node_args, "--metrics-addr", f"127.0.0.1:{self.port}", "--checkpoint-dir", str(directory / "ckpt")]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        with inherited({hostile.ENV: self.spec, STEP_ENV: str(self.step_seconds) if self.step_seconds else None}):
            self.node = LocalNode(directory, args)
        return self.node

    def scrape(self) -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                self.metrics = r.read().decode()
        except OSError:
            pass


class Scenario:
    """One fresh swarm: the honest peers and the hostile ones (none for the clean run)."""

    def __init__(self, name: str, label: str, args: argparse.Namespace, out: Path, honest: list[Peer],
                 hostile_: list[Peer]):
        self.name, self.label, self.args, self.dir = name, label, args, out / name
        self.honest, self.hostile = honest, hostile_
        self.announced: set[tuple[int, str]] = set()  # (round, hash) the hostile peers announced
        self.node_args = [
            "--run-id", "attack", "--model", "tiny", "--inner-steps", str(args.inner_steps), "--threads", "1",
            "--seed", str(args.seed), "--min-peers", str(args.min_peers),
            "--set", f"swarm.heartbeat_interval={HEARTBEAT}", "--set", f"swarm.request_timeout={REQUEST}",
            "--set", f"swarm.round_timeout={ROUND}", "--set", f"swarm.gather_timeout={GATHER}",
            "--set", "data.batch_size=4", "--set", "data.seq_len=64", "--set", "data.eval_every=1",
            "--set", f"swarm.codec={args.codec}",
            *(("--set", f"inner.round_seconds={args.round_seconds}") if args.paced else ()),
            *(x for kv in args.settings for x in ("--set", kv)),
        ]

    @property
    def peers(self) -> list[Peer]:
        return self.honest + self.hostile

    def run(self) -> dict:
        t0 = time.time()
        shutil.rmtree(self.dir, ignore_errors=True)  # a fresh swarm: no checkpoint or log of an earlier run
        for p in self.hostile:  # ... and no pseudo-gradient colluders left in one (PATH.<round>)
            b = hostile.parse(p.spec)
            for path in filter(None, (b.copy_to, b.copy_from)):
                for old in Path(path).parent.glob(Path(path).name + ".*"):
                    old.unlink()
        first = self.honest[0].start(self.dir / self.honest[0].name, self.node_args, None)
        addr = first.address(timeout=180)
        if addr is None:
            raise SystemExit(f"{self.name}: first peer did not start:\n{first.log()[-2000:]}")
        for p in self.peers[1:]:
            p.start(self.dir / p.name, self.node_args, addr)
        slow = sum(p.slow for p in self.honest)
        print(f"{self.name}: {len(self.honest)} honest{f' ({slow} slow)' if slow else ''} + {len(self.hostile)} "
              f"hostile peers ({', '.join(p.spec for p in self.hostile) or 'none'}), until round {self.args.rounds}",
              flush=True)
        end, last_poll = t0 + self.args.duration, 0.0
        while time.time() < end and min(self.held_round(p) for p in self.honest) < self.args.rounds:
            time.sleep(1.0)
            if time.time() - last_poll >= 3.0:
                last_poll = time.time()
                self.poll(t0)
        reached = min(self.held_round(p) for p in self.honest)
        final = self.settle(timeout=60)
        for p in self.peers:
            p.scrape()
        elapsed = time.time() - t0
        stop(self.peers)
        result = scenario_result(self.name, self.honest, self.hostile, self.announced, final, reached, t0, elapsed)
        return {"label": self.label, **result}

    def held_round(self, p: Peer) -> int:
        events = p.node.events() if p.node else []
        return max((r for _, _, r, _ in events), default=0)

    def poll(self, t0: float) -> None:
        """Record what the hostile peers announce (from an honest peer's table), scrape
        metrics, and note any peer that exited."""
        for p in self.peers:
            if p.node and not p.node.alive() and p.died_at is None:
                p.died_at = round(time.time() - t0, 1)
                print(f"  {p.name} exited (code {p.node.proc.returncode}) at t={p.died_at}s", flush=True)
        ids = {p.peer_id for p in self.hostile}
        for p in self.honest:
            if ids and p.node.alive():
                try:
                    table = request(p.node.control, "peers", timeout=2.0)
                except (ConnectionError, RuntimeError):
                    continue
                self.announced |= {(e["round"], e["params_hash"][:H]) for e in table
                                   if e.get("peer_id") in ids and e.get("params_hash")}
                break
        for p in self.honest:
            p.scrape()

    def settle(self, timeout: float) -> dict:
        """Wait until every honest peer answers with the same (round, params_hash)."""
        deadline, states = time.time() + timeout, {}
        while time.time() < deadline:
            states = {p.name: p.node.live_status() for p in self.honest}
            keys = {(s["round"], s["params_hash"]) for s in states.values() if s}
            if len(keys) == 1 and all(states.values()):
                (round_, h), = keys
                return {"agree": True, "round": round_, "params_hash": h}
            time.sleep(0.2)
        return {"agree": False, "peers": {n: s and {"round": s["round"], "params_hash": s["params_hash"]}
                                          for n, s in states.items()}}

def stop(peers: list[Peer], timeout: float = 30) -> None:
    """SIGTERM every live peer at once, wait, SIGKILL whoever is left (by pid)."""
    nodes = [p for p in peers if p.node is not None]
    for p in nodes:
        if p.node.alive():
            p.node.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + timeout
    for p in nodes:
        try:
            p.node.proc.wait(max(0.1, deadline - time.time()))
        except Exception:
            pass
        p.exit = p.node.stop(signal.SIGKILL, timeout=10)


def code_version() -> dict:
    """The commit the peers ran, and the files that differed from it (uncommitted work)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "modified": git("status", "--porcelain", "-uno").splitlines()}


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    # Ctrl-C or a kill stops every peer (by pid), even where the shell started us with SIGINT ignored.
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    for var in (hostile.ENV, "GONKA_TEST_FAULT", STEP_ENV):  # peers must not inherit a lie, a fault or a pace
        os.environ.pop(var, None)
    out = Path(args.out)
    (out / "keys").mkdir(parents=True, exist_ok=True)
    fast, slow = (args.step_seconds, args.slow_step_seconds) if args.paced else (None, None)
    honest = []
    for i in range(args.honest):
        at_half = i >= args.honest - args.slow
        honest.append(Peer(f"honest{i}", out / "keys" / f"honest{i}.key", None, slow if at_half else fast, at_half))
    if args.paced:
        print(f"paced: steps wait {fast} s ({', '.join(p.name for p in honest if p.slow) or 'no peer'} at half speed: "
              f"{slow} s), rounds end after {args.round_seconds} s", flush=True)
    scenarios = []
    if not args.no_clean:
        scenarios.append(("clean", "clean", []))
    for i, (label, specs) in enumerate(args.scenarios):
        name = re.sub(r"[^\w.+-]", "_", label)
        for j in range(len(specs)):
            leading_key(out / "keys" / f"hostile{j}.key", below=min(p.peer_id for p in honest))
        hostiles = [Peer(f"hostile{j}", out / "keys" / f"hostile{j}.key", s, fast) for j, s in enumerate(specs)]
        scenarios.append((f"{i + 1:02d}-{name}", label, hostiles))
    results: list[dict] = []
    code = code_version()
    clean = None
    running: list[Peer] = []

    try:
        for name, label, hostiles in scenarios:
            for p in honest:
                p.node, p.metrics, p.exit, p.died_at = None, "", None, None
            running[:] = honest + hostiles
            result = Scenario(name, label, args, out, honest, hostiles).run()
            if name == "clean":
                clean = result
            compare(result, clean, BOUND)
            results.append(result)
            (out / "attack.json").write_text(json.dumps({"args": vars(args), "code": code, "goals": GOALS,
                                                         "results": results}, indent=2) + "\n")
            print_table(results[-1:])
            print_ledger_table(results[-1:])
    except KeyboardInterrupt:
        print("interrupted: stopping every peer", file=sys.stderr)
        return 130
    finally:
        stop(running, timeout=10)
    print_table(results)
    print_ledger_table(results)
    print(f"details in {out / 'attack.json'}")
    bad = [r for r in results if r["hostile"] and not all(r["goals"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
