"""TCP throughput and ping probes between two hosts of a testbed (scripts/netbed.py).

``measure_tcp`` starts a receiver in one host's namespace and a sender in
another's (this file run as a script, standard library only), bounded in time
and bytes, and returns the goodput the receiver saw. ``ping`` sends ICMP echo
requests from one host to another (a raw socket: needs root, not iputils) and
returns each one's round-trip time, or None for those lost.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from netbed import Testbed, TestbedError



def measure_tcp(tb: Testbed, src: int, dst: int, seconds: float = 3.0, port: int = 5201,
                warmup: float = 0.5) -> float:
    """TCP throughput from host src to host dst in bits/s, as the receiver sees it after ``warmup`` seconds
    (at most a fifth of the run: the tbf bucket starts full, and slow start takes a few RTTs)."""
    if src == dst:
        raise ValueError(f"measure between two different hosts, got h{src} -> h{dst}")
    nominal = tb.nominal_rate(src, dst)
    max_bytes = int(nominal / 8 * seconds * 2) + (1 << 20)  # bound the run even if shaping failed
    # A send buffer of ~0.2 s of traffic plus the bandwidth-delay product: enough to keep the link
    # full, small enough that the sender's queue drains soon after it stops. With stock buffers the
    # probe sets none, as most programs do, and gets what Linux's autotuning gives.
    sndbuf = 0 if tb.tcp_buffers == "stock" else max(128 * 1024, int(nominal / 8 * (0.2 + tb.rtt(src, dst))))
    probe = [sys.executable, str(Path(__file__).resolve())]
    send = None
    recv = tb.run(dst, [*probe, "tcp-recv", tb.local_ip(dst), str(port), str(seconds + 20), str(warmup)],
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


def ping(tb: Testbed, src: int, dst: int, count: int = 20, interval: float = 0.02,
         timeout: float = 2.0) -> list[float | None]:
    """Round-trip times in seconds of ``count`` ICMP echoes from host src to host dst, sent ``interval``
    apart; None for each one with no reply ``timeout`` seconds after the last was sent."""
    if not (1 <= count <= 100_000 and 0 < interval <= 10 and 0 < timeout <= 60):
        raise ValueError(f"ping count 1-100000, interval 0-10 s, timeout 0-60 s; got {count}, {interval}, {timeout}")
    probe = [sys.executable, str(Path(__file__).resolve()), "ping", tb.host_ip(dst), str(count), str(interval),
             str(timeout)]
    proc = tb.run(src, probe, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=count * interval + timeout + 15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise TestbedError(f"ping h{src} -> h{dst} did not finish") from None
    if proc.returncode != 0:
        raise TestbedError(f"ping h{src} -> h{dst} failed (exit {proc.returncode})")
    return json.loads(out)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    return proc.stdout.readline()


def _tcp_recv(host: str, port: int, timeout: float, warmup: float) -> None:
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
        start = marks[0][0] + min(warmup, (marks[-1][0] - marks[0][0]) / 5)
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
        # An explicit buffer is capped at net.core.wmem_max, which only the root namespace may raise:
        # above it, autotuning (up to the host's tcp_wmem) gives more.
        if 0 < sndbuf <= int(Path("/proc/sys/net/core/wmem_max").read_text()):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.settimeout(seconds + 10)
        payload, sent, end = memoryview(bytes(1 << 16)), 0, time.monotonic() + seconds
        while sent < max_bytes and time.monotonic() < end:
            sent += sock.send(payload[: max_bytes - sent])
        sock.shutdown(socket.SHUT_WR)
        try:
            sock.recv(1)  # the receiver closes after EOF: by then everything sent has arrived
        except TimeoutError:
            pass  # a link that barely moves (heavy loss): the receiver reports what came at its own deadline


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def _ping(host: str, count: int, interval: float, timeout: float) -> None:
    """Print the RTTs (seconds, null if lost) of ``count`` ICMP echoes to host as a JSON list."""
    ident, payload = os.getpid() & 0xFFFF, bytes(56)
    sent: dict[int, float] = {}
    rtts: list[float | None] = [None] * count
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.setblocking(False)
        start = time.monotonic()
        last = start + (count - 1) * interval
        seq = 0
        while True:
            now = time.monotonic()
            if seq < count and now >= start + seq * interval:
                header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
                packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, seq) + payload
                sent[seq] = time.monotonic()
                sock.sendto(packet, (host, 0))
                seq += 1
                continue
            if seq == count and (now >= last + timeout or all(r is not None for r in rtts)):
                break
            wake = start + seq * interval if seq < count else last + timeout
            with selectors.DefaultSelector() as sel:
                sel.register(sock, selectors.EVENT_READ)
                ready = sel.select(max(0.0, wake - now))
            while ready:
                try:
                    data, _ = sock.recvfrom(2048)
                except BlockingIOError:
                    break
                arrived = time.monotonic()
                ihl = (data[0] & 0x0F) * 4
                kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
                if kind == 0 and rid == ident and rseq in sent and rtts[rseq] is None:
                    rtts[rseq] = arrived - sent[rseq]
    print(json.dumps(rtts), flush=True)


if __name__ == "__main__":
    role, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if role == "tcp-recv":
        _tcp_recv(args[0], int(args[1]), float(args[2]), float(args[3]))
    elif role == "tcp-send":
        _tcp_send(args[0], int(args[1]), float(args[2]), int(args[3]), int(args[4]))
    elif role == "ping":
        _ping(args[0], int(args[1]), float(args[2]), float(args[3]))
    else:
        sys.exit(f"netprobe.py: unknown probe role {role!r} (tcp-recv, tcp-send, ping)")
