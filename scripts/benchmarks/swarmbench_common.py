"""What the swarm benchmarks (``scale``, ``join``, ``utilization``) share.

Reading a node's log and its Prometheus text, building `gonka-node start`
command lines for testbed hosts, the size of a model preset, medians that
tolerate missing values, and a small bounded wait. Nothing here starts a
process by itself: each benchmark owns its processes and kills them on exit.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPTS = ROOT / "scripts"
NODE_BIN = Path(sys.executable).with_name("gonka-node")

# Settings every benchmark node gets: small batches so a 2-core machine runs several nodes.
FAST_NODE_SETTINGS = ["--set", "data.batch_size=4", "--set", "data.seq_len=64"]
# Heartbeats every 0.5 s on the LAN testbed (the default is 2 s). A heartbeat lives 3 intervals,
# and storing one in the DHT takes a few round trips: far apart, the interval grows with the RTT.
FAST_HEARTBEAT_S = 0.5


def heartbeat_for(rtt_ms: float) -> float:
    """The testbed nodes' heartbeat interval for hosts ``rtt_ms`` apart: 0.5 s, or 8 RTTs if longer."""
    return max(FAST_HEARTBEAT_S, 8 * rtt_ms / 1000)


_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) "
COMMIT = re.compile(_STAMP + r"INFO gonka\.node: committed round=(\d+) hash=([0-9a-f]+) members=(\d+) group=(\S*) "
                    r"loss=(\S+) eval_loss=(\S+) allreduce=([0-9.]+)s", re.M)
RESYNC = re.compile(_STAMP + r"INFO gonka\.node: resynced round=(\d+) hash=([0-9a-f]+) reason=(\S+) donors=(\d+)", re.M)
DOWNLOAD = re.compile(_STAMP + r"INFO \S+: downloaded round (\d+) state \(([0-9.]+) MB\) from (\d+) donors in ([0-9.]+)s",
                      re.M)
ABORT = re.compile(_STAMP + r"(?:INFO|WARNING) \S+: (?:aborted round=(\d+)|round (\d+) attempt)", re.M)


def stamp_to_unix(stamp: str, ms: str) -> float:
    """A log timestamp (local time, as the logging module writes it) as unix seconds."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def commits(log: str) -> list[dict]:
    """Every `committed round=...` line of a node log, in order."""
    out = []
    for stamp, ms, rnd, h, members, group, loss, eval_loss, allreduce in COMMIT.findall(log):
        out.append({"t": stamp_to_unix(stamp, ms), "round": int(rnd), "hash": h, "members": int(members),
                    "group": group, "loss": float(loss), "eval_loss": float(eval_loss), "allreduce": float(allreduce)})
    return out


def downloads(log: str) -> list[dict]:
    """Every `downloaded round R state (X MB) from D donors in S s` line of a node log."""
    return [{"t": stamp_to_unix(stamp, ms), "round": int(rnd), "mb": float(mb), "donors": int(d), "seconds": float(s)}
            for stamp, ms, rnd, mb, d, s in DOWNLOAD.findall(log)]


def aborted_attempts(log: str) -> int:
    return len(ABORT.findall(log))


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (labels verbatim, comments skipped)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def state_numel(preset: str) -> int:
    """Parameters of a model preset (tied weights counted once), built on the meta device: no memory, no time."""
    import torch

    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM

    from trainer.model import preset_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(preset))
    return sum(p.numel() for p in model.parameters())


def state_bytes(preset: str) -> int:
    """Bytes a joiner downloads: fp32 parameters and outer momentum (p2p/transfer.py's expected size)."""
    return 2 * 4 * state_numel(preset)


def node_argv(*, ip: str, port: int, run_id: str, workdir: Path, model: str, inner_steps: int, min_peers: int,
              max_rounds: int = 0, bootstrap: str | None = None, metrics_port: int | None = None,
              extra: list[str] = (), heartbeat: float = FAST_HEARTBEAT_S) -> list[str]:
    """`gonka-node start` for a testbed host: listens on its own address, no control socket, 1 torch thread."""
    argv = [str(NODE_BIN), "start", "--run-id", run_id, "--listen", f"/ip4/{ip}/tcp/{port}", "--model", model,
            "--inner-steps", str(inner_steps), "--min-peers", str(min_peers), "--max-rounds", str(max_rounds),
            "--threads", "1", "--device", "cpu", "--control", "off", "--status-file", str(workdir / "status.json"),
            "--metrics-addr", f"{ip}:{metrics_port}" if metrics_port else "off", *FAST_NODE_SETTINGS,
            "--set", f"swarm.heartbeat_interval={heartbeat:g}", *extra]
    if bootstrap:
        argv += ["--bootstrap", bootstrap]
    return argv


def listening_address(log_path: Path, proc, timeout: float) -> str | None:
    """The first `listening on MULTIADDR` of a node's log; None if it exits or the time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"^listening on (\S+)", read_text(log_path), re.M)
        if m:
            return m.group(1)
        time.sleep(0.2)
    return None


def log_tail(path: Path, lines: int = 20) -> str:
    text = read_text(path).splitlines()
    return "\n".join("    " + line for line in text[-lines:]) or "    (empty log)"


def stop_all(procs, grace: float = 15.0) -> None:
    """SIGTERM every process still running, then SIGKILL what is left after `grace` seconds."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except Exception:
            p.kill()
            p.wait(10)


def process_tree(pid: int) -> list[int]:
    """pid and every process below it, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [pid], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (``VmRSS``; ``VmHWM``: its peak), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
