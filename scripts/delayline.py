"""Build and run the testbed's delay line (scripts/delayline.c), one process per WAN link.

The C program is compiled with ``$CC`` (default ``cc``) once per machine into
``$GONKA_NATIVE_DIR``, else ``$XDG_CACHE_HOME/gonka-node``, else
``~/.cache/gonka-node``, under a name that hashes the source, the flags and the
compiler (a changed source is rebuilt). It is compiled to a temporary name and
renamed into place, so two testbeds starting at once never run a half-written
binary (as p2p/native.py does for the codec kernels).

``start`` runs one delay line and returns once both of its TAP devices exist;
``stats`` asks a running one for its counters. Stopping is the testbed's
business: it kills every process it started (SIGTERM writes the counters).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import selectors
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("delayline.c")
FLAGS = ["-O2", "-std=gnu11", "-Wall"]
BUILD_TIMEOUT_S = 120.0
START_TIMEOUT_S = 10.0  # for both TAPs to exist
STATS_TIMEOUT_S = 5.0  # for a running delay line to answer SIGUSR1 or SIGUSR2


class DelayLineError(RuntimeError):
    """The delay line could not be built, started or read; the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Direction:
    """What one direction of a link does to each frame."""

    delay: float = 0.0  # seconds added to every frame
    jitter: float = 0.0  # up to this many seconds more, uniformly drawn, never reordering
    loss: float = 0.0  # probability that a frame is dropped

    def argv(self, name: str) -> list[str]:
        return [f"--{name}-delay-us", str(round(self.delay * 1e6)), f"--{name}-jitter-us",
                str(round(self.jitter * 1e6)), f"--{name}-loss", repr(float(self.loss))]


def cache_dir() -> Path:
    if os.environ.get("GONKA_NATIVE_DIR"):
        return Path(os.environ["GONKA_NATIVE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gonka-node"


def build() -> Path:
    """The delay line's executable, compiled now unless this build exists; DelayLineError if it fails."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join([*compiler, *FLAGS, platform.machine(), sys.platform]).encode())
    path = cache_dir() / f"delayline-{h.hexdigest()[:16]}"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise DelayLineError(f"building {SOURCE.name} with {' '.join(compiler)} failed: "
                             f"{detail.strip().splitlines()[0] if detail.strip() else exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def start(a: tuple[str, str], b: tuple[str, str], up: Direction, down: Direction, queue_bytes: int,
          stats_path: Path, log_path: Path, seed: int) -> subprocess.Popen:
    """Run a delay line between TAP ``a`` = (namespace, device) and TAP ``b``; return once both exist.

    ``up`` acts on frames from a to b, ``down`` on frames from b to a. The process ends up in b's
    namespace and dies with this one (unless ``detach``ed). DelayLineError if it does not start."""
    argv = [str(build()), "--a-ns", a[0], "--a-dev", a[1], "--b-ns", b[0], "--b-dev", b[1], *up.argv("up"),
            *down.argv("down"), "--queue-bytes", str(queue_bytes), "--seed", str(seed), "--stats", str(stats_path),
            "--parent", str(os.getpid())]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(START_TIMEOUT_S) and proc.stdout.readline().strip() == b"ready"
    finally:
        proc.stdout.close()
    if not ready:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise DelayLineError(f"delay line {a[0]}/{a[1]} <-> {b[0]}/{b[1]} did not start "
                             f"(exit {proc.returncode}): {_tail(log_path)}")
    return proc


def stats(pid: int, stats_path: Path, detach: bool = False) -> dict:
    """Counters of a running delay line (SIGUSR1); with ``detach``, first let it outlive its parent (SIGUSR2).

    Frames in, out and dropped (by reason: loss, queue, write) per direction, "up" and "down"."""
    try:
        stats_path.unlink()  # the answer is the file's reappearance
    except FileNotFoundError:
        pass
    os.kill(pid, signal.SIGUSR2 if detach else signal.SIGUSR1)
    deadline = time.monotonic() + STATS_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            data = json.loads(stats_path.read_text())
            if data.get("detached") or not detach:
                return data
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.01)
    raise DelayLineError(f"delay line {pid} did not answer within {STATS_TIMEOUT_S:.0f}s")


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"


if __name__ == "__main__":  # build now, e.g. from scripts/setup
    print(f"delay line: {build()}")
