"""Run real `gonka-node start` processes on loopback, for the demo, chaos runs and benchmarks.

Each node gets its own directory (log, status file, control socket, identity,
checkpoints), so a node restarted in the same directory keeps its peer id and
resumes from its checkpoint.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).with_name("gonka-node")
EVENT = re.compile(r"^(\S+ \S+),(\d+) INFO gonka.node: (committed|resynced) round=(\d+) hash=([0-9a-f]+)", re.M)


class LocalNode:
    """One gonka-node process (one incarnation of a node directory)."""

    def __init__(self, directory: Path, args: list[str], *, log_name: str = "node.log"):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / log_name
        self.status_path = self.dir / "status.json"
        self.control = str(self.dir / "control.sock")
        cmd = [str(BIN), "start", "--status-file", str(self.status_path), "--control", self.control,
               "--identity", str(self.dir / "identity.key"), *args]
        self._log = open(self.log_path, "ab")
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def address(self, timeout: float) -> str | None:
        """The first multiaddr the node prints, or None if it exits or times out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            m = re.search(r"^listening on (\S+)", self.log(), re.M)
            if m:
                return m.group(1)
            time.sleep(0.1)
        return None

    def status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def live_status(self) -> dict | None:
        """Ask the running node over its control socket; None if it does not answer."""
        from node.control import request

        try:
            return request(self.control, "status", timeout=2.0)
        except Exception:
            return None

    def events(self) -> list[tuple[float, str, int, str]]:
        """(unix time, committed|resynced, round, params_hash) from this node's log."""
        out = []
        for stamp, ms, kind, rnd, h in EVENT.findall(self.log()):
            t = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
            out.append((t, kind, int(rnd), h))
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        if self.alive():
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
        finally:
            self._log.close()
