"""Real gonka-node processes for integration tests: started through the CLI, on loopback.

Every process a test starts is tracked by pid, together with its descendants
(p2pd), and killed at teardown if still alive; tests wait on log lines and
files with timeouts, never on fixed sleeps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).with_name("gonka-node")

# Short timings so rounds turn over quickly on a 2-core machine.
FAST = [
    "--metrics-addr", "off", "--threads", "1", "--model", "tiny",
    "--set", "swarm.heartbeat_interval=0.5", "--set", "swarm.gather_timeout=20",
    "--set", "swarm.round_timeout=20", "--set", "swarm.request_timeout=5",
    "--set", "data.batch_size=4", "--set", "data.seq_len=32", "--set", "data.eval_batches=2",
]

# Every inner step waits this long first, as a host's steps wait on its accelerator with the CPU
# idle (p2p/faults.py): a swarm's rounds then leave the machine's cores to the suite's other
# processes (tests/streams.py) instead of spinning through tiny steps back to back.
STEP_ENV, STEP_SECONDS = "GONKA_TEST_STEP_SECONDS", "0.05"

# The bound docs/faults.md documents for the FAST settings of nodes.py: a survivor commits
# within round_timeout (detect) + max(3 heartbeats, request_timeout) (regroup)
# + round_timeout (the retried all-reduce) of a fault.
HEARTBEAT, REQUEST, ROUND = 0.5, 5.0, 20.0
BOUND = ROUND + max(3 * HEARTBEAT, REQUEST) + ROUND

COMMITTED = re.compile(r"(committed|resynced) round=(\d+) hash=([0-9a-f]+)")
LOSS = re.compile(r"committed round=(\d+) .* loss=([0-9.]+)")


def children_of(pid: int) -> list[int]:
    """Direct and indirect children of pid, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class NodeProc:
    def __init__(self, name: str, workdir: Path, args: list[str], registry: list["NodeProc"],
                 env: dict[str, str] | None = None):
        self.name = name
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "log.txt"
        self.status_path = self.dir / "status.json"
        self.control = str(self.dir / "control.sock")
        cmd = [str(BIN), "start", *FAST, "--status-file", str(self.status_path), "--control", self.control, *args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, STEP_ENV: STEP_SECONDS, **(env or {})})
        self.known_children: set[int] = set()
        registry.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def address(self, timeout: float = 60) -> str:
        m = wait_until(lambda: re.search(r"^listening on (\S+)", self.log(), re.M), timeout, f"{self.name} to listen")
        return m.group(1)

    def peer_id(self) -> str:
        return re.search(r"^gonka-node \S+ peer (\S+)", self.log(), re.M).group(1)

    def quarantined(self) -> set[str]:
        """The last 8 characters of every peer id this node quarantined (its log says so)."""
        return set(re.findall(r"quarantined peer (\S+) for", self.log()))

    def rounds(self) -> dict[int, str]:
        """round -> params_hash for every round this node committed or re-synced to."""
        return {int(r): h for _, r, h in COMMITTED.findall(self.log())}

    def losses(self) -> list[float]:
        return [float(l) for _, l in sorted((int(r), l) for r, l in LOSS.findall(self.log()))]

    def wait_round(self, n: int, timeout: float) -> None:
        wait_until(lambda: max(self.rounds(), default=0) >= n or self.proc.poll() is not None, timeout,
                   f"{self.name} to reach round {n}")
        assert max(self.rounds(), default=0) >= n, f"{self.name} exited early:\n{self.log()[-3000:]}"

    def status(self) -> dict:
        return json.loads(self.status_path.read_text())

    def p2pd_pids(self) -> list[int]:
        kids = children_of(self.pid)
        self.known_children.update(kids)
        return [k for k in kids if Path(f"/proc/{k}/comm").read_text().strip() == "p2pd"]

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit in {timeout}s:\n{self.log()[-3000:]}") from None

    def kill_all(self) -> None:
        """Teardown: kill the node and everything it started, by pid."""
        self.known_children.update(children_of(self.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.known_children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._log.close()


def commit_times(node, resynced: bool = False) -> list[tuple[float, int]]:
    """(wall time, round) of every commit in the node's log (and, with ``resynced``, of every
    committed state it downloaded instead, as a member left out of a round does)."""
    kinds = "committed|resynced" if resynced else "committed"
    out = []
    for stamp, r in re.findall(rf"^(\S+ \S+),\d+ INFO gonka.node: (?:{kinds}) round=(\d+)", node.log(), re.M):
        out.append((time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")), int(r)))
    return out


def check_recovered(survivors, fault_round: int, died: float) -> None:
    """After a member died in ``fault_round`` at ``died``: a majority of the survivors committed
    that round (or a later one) within BOUND of the death, and every survivor holds such a
    committed state within BOUND, by its own commit or, left out of the retried round as a
    straggler, by downloading it (docs/faults.md, "Bounded time")."""
    def first_after(node, resynced: bool) -> float | None:
        times = [t for t, r in commit_times(node, resynced) if r >= fault_round and t >= died - 1]
        return times[0] if times else None

    reached = {n.name: first_after(n, True) for n in survivors}
    assert all(t is not None and t - died <= BOUND for t in reached.values()), (fault_round, died, reached)
    committed = [n.name for n in survivors if (t := first_after(n, False)) is not None and t - died <= BOUND]
    assert 2 * len(committed) > len(survivors), (fault_round, died, committed, reached)
