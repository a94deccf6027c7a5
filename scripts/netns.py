"""Network namespaces and the processes in them: the testbed's shell-level tools (scripts/netbed.py).

``cmd`` runs one `ip` or `tc` command and turns its failure into a
``TestbedError`` that says what failed; the rest finds the processes a testbed
must stop at teardown (its children, their descendants, whatever else runs in
its namespaces) and stops them, SIGTERM first and SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

GRACE_SECONDS = 3.0  # how long processes get between SIGTERM and SIGKILL at teardown


class TestbedError(RuntimeError):
    """The testbed cannot be created, used or removed; the message says why and what to do."""

    __test__ = False  # not a pytest test class


def require_root() -> None:
    """Raise TestbedError unless this process can create namespaces and shape links."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, veth, tc): run it with sudo")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TestbedError(f"the testbed needs iproute2; not found: {', '.join(missing)}")


def cmd(*argv: str, timeout: float = 15) -> str:
    """Run argv to completion and return its stdout; TestbedError if it fails or overruns."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(argv)}` did not finish in {timeout:.0f}s") from None
    if r.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def list_namespaces() -> list[str]:
    """Names of all network namespaces `ip netns` knows."""
    return [line.split()[0] for line in cmd("ip", "netns", "list").splitlines() if line.strip()]


def netns_pids(ns: str) -> set[int]:
    """The processes running in namespace ``ns`` (none if it is gone)."""
    try:
        return {int(p) for p in cmd("ip", "netns", "pids", ns).split()}
    except TestbedError:  # the namespace is already gone
        return set()


def start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) process in clock ticks since boot; None if there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def descendants(roots: set[int]) -> set[int]:
    """Every live process descended from one of ``roots`` (not the roots themselves)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), list(roots)
    while frontier:
        parent = frontier.pop()
        kids = [c for c, p in parents.items() if p == parent and c not in found]
        found.update(kids)
        frontier += kids
    return found


def stop_processes(procs: list[subprocess.Popen], namespaces: list[str]) -> list[subprocess.Popen]:
    """Stop ``procs``, their descendants and every process in ``namespaces``: SIGTERM, then
    SIGKILL after GRACE_SECONDS. Returns the ``procs`` still not reaped."""

    def victims() -> set[int]:
        pids = {p.pid for p in procs if p.poll() is None}  # not reaped, so the pid is still theirs
        pids |= descendants({p.pid for p in procs})
        for ns in namespaces:  # also whatever `scripts/testbed run` or a reparented child left there
            pids |= netns_pids(ns)
        pids.discard(os.getpid())
        return {p for p in pids if start_time(p) is not None}

    alive = victims()
    for pid in alive:
        send_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while alive and time.monotonic() < deadline:
        for p in procs:
            p.poll()  # reap, so a finished child stops counting as alive
        alive = {p for p in alive if start_time(p) is not None}
        time.sleep(0.05)
    for _ in range(3):  # a process may fork while we kill; look again
        alive = victims()
        if not alive:
            break
        for pid in alive:
            send_signal(pid, signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.05)
    return [p for p in procs if p.poll() is None]


def send_signal(pid: int, signum: int) -> None:
    """Signal ``pid``; one that is gone already is not an error."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
