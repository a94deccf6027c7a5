"""TCP throughput probe between two hosts of a testbed (scripts/netbed.py).

``measure_tcp`` starts a receiver in one host's namespace and a sender in
another's (this file run as a script, standard library only), bounded in time
and bytes, and returns the goodput the receiver saw.
"""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

from netbed import Testbed, TestbedError



def measure_tcp(tb: Testbed, src: int, dst: int, seconds: float = 3.0, port: int = 5201) -> float:
    """TCP throughput from host src to host dst in bits/s, as the receiver sees it."""
    if src == dst:
        raise ValueError(f"measure between two different hosts, got h{src} -> h{dst}")
    nominal = min(tb.rates[src], tb.rates[dst])
    max_bytes = int(nominal / 8 * seconds * 2) + (1 << 20)  # bound the run even if shaping failed
    # A send buffer of ~0.2 s of traffic: enough to keep the link full, small enough that the
    # sender's queue drains soon after it stops.
    sndbuf = max(128 * 1024, int(nominal / 8 * 0.2))
    probe = [sys.executable, str(Path(__file__).resolve())]
    send = None
    recv = tb.run(dst, [*probe, "tcp-recv", tb.host_ip(dst), str(port), str(seconds + 20)],
                  stdout=subprocess.PIPE, text=True)
    try:
        if _readline(recv, timeout=15).strip() != "ready":
            raise TestbedError(f"throughput receiver in host {dst} did not start")
        send = tb.run(src, [*probe, "tcp-send", tb.host_ip(dst), str(port), str(seconds), str(max_bytes),
                            str(sndbuf)])
        send.wait(timeout=seconds + 30)
        result = json.loads(_readline(recv, timeout=30) or "{}")
        recv.wait(timeout=10)
    except (subprocess.TimeoutExpired, ValueError) as exc:
        raise TestbedError(f"throughput probe h{src} -> h{dst} failed: {exc}") from None
    finally:
        for p in (recv, send):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    if send.returncode != 0 or "rate_bps" not in result:
        raise TestbedError(f"throughput probe h{src} -> h{dst} failed (sender exit {send.returncode})")
    return float(result["rate_bps"])


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    return proc.stdout.readline()


def _tcp_recv(host: str, port: int, timeout: float) -> None:
    """Accept one connection, read to EOF, print {"bytes", "rate_bps"} as JSON."""
    with socket.create_server((host, port)) as srv:
        srv.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = srv.accept()
    deadline = time.monotonic() + timeout
    buf, marks, total = bytearray(1 << 18), [], 0
    with conn:
        conn.settimeout(timeout)
        while time.monotonic() < deadline:
            n = conn.recv_into(buf)
            if n == 0:
                break
            total += n
            marks.append((time.monotonic(), total))
    rate = 0.0
    if len(marks) > 1:
        # Skip the first 0.5 s (at most a fifth of the run): the tbf bucket starts full.
        start = marks[0][0] + min(0.5, (marks[-1][0] - marks[0][0]) / 5)
        t0, b0 = next(m for m in marks if m[0] >= start)
        if marks[-1][0] > t0:
            rate = (total - b0) * 8 / (marks[-1][0] - t0)
    print(json.dumps({"bytes": total, "rate_bps": rate}), flush=True)


def _tcp_send(host: str, port: int, seconds: float, max_bytes: int, sndbuf: int) -> None:
    """Send zeros to host:port for `seconds` or `max_bytes`, whichever ends first."""
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.settimeout(seconds + 10)
        payload, sent, end = memoryview(bytes(1 << 16)), 0, time.monotonic() + seconds
        while sent < max_bytes and time.monotonic() < end:
            sent += sock.send(payload[: max_bytes - sent])
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the receiver closes after EOF: by then everything sent has arrived


if __name__ == "__main__":
    role, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if role == "tcp-recv":
        _tcp_recv(args[0], int(args[1]), float(args[2]))
    elif role == "tcp-send":
        _tcp_send(args[0], int(args[1]), float(args[2]), int(args[3]), int(args[4]))
    else:
        sys.exit(f"netprobe.py: unknown probe role {role!r} (tcp-recv, tcp-send)")
