"""How faithful and how costly the testbed's WAN links are (scripts/delayline.c): figures for docs/testbed.md.

Each figure is the median of --runs runs, each on a fresh two-host testbed
(root, testbed namespaces only):
  rtt       ping RTT median error at RTT 0/50/100/250 ms
  jitter    ping RTT spread (p5..p95) for each host's jitter at RTT 100 ms
  loss      measured ping loss vs the one expected from each link's loss
  tcp       one TCP stream's goodput at 100 Mbit/s for those RTTs, stock and raised buffers
  cpu       the delay lines' CPU (utime+stime) per GB moved, and % of one core, at 100 Mbit/s both ways

  sudo .venv/bin/python scripts/benchmarks/wan.py [--runs 3] [--only rtt,tcp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import netbed  # noqa: E402
import netprobe  # noqa: E402

RTTS_MS = [0, 50, 100, 250]
TICKS = os.sysconf("SC_CLK_TCK")


def prefix(tag: str) -> str:
    return f"bw{os.getpid() % 100000}{tag}"


def pings(tb: netbed.Testbed, count: int) -> list[float | None]:
    netprobe.ping(tb, 0, 1, count=1, timeout=3)  # resolve the neighbours first: ARP crosses the delay too
    return netprobe.ping(tb, 0, 1, count=count, interval=0.01, timeout=2)


def bench_rtt(runs: int) -> None:
    for rtt in RTTS_MS:
        errors = []
        for _ in range(runs):
            with netbed.Testbed(2, prefix=prefix("rtt"), delay=f"{rtt / 2}ms") as tb:
                got = [r for r in pings(tb, 100) if r is not None]
                errors.append(statistics.median(got) * 1e3 - rtt)
        print(f"rtt {rtt} ms: median error {statistics.median(errors):+.3f} ms (runs {', '.join(f'{e:+.3f}' for e in errors)})",
              flush=True)


def bench_jitter(runs: int) -> None:
    for jitter in (0, 2, 10, 40):
        spreads, medians = [], []
        for _ in range(runs):
            with netbed.Testbed(2, prefix=prefix("jit"), delay="50ms", jitter=f"{jitter}ms") as tb:
                got = sorted(r * 1e3 for r in pings(tb, 200) if r is not None)
                spreads.append(got[int(0.95 * len(got))] - got[int(0.05 * len(got))])
                medians.append(statistics.median(got))
        print(f"jitter {jitter} ms per host (RTT 100 ms): RTT median {statistics.median(medians):.2f} ms, "
              f"p5..p95 spread {statistics.median(spreads):.2f} ms", flush=True)


def bench_loss(runs: int) -> None:
    for percent in (0.1, 1, 5, 20):
        measured = []
        for _ in range(runs):
            with netbed.Testbed(2, prefix=prefix("loss"), delay="1ms", loss=percent / 100) as tb:
                rtts = netprobe.ping(tb, 0, 1, count=2000, interval=0.001, timeout=1)
                measured.append(sum(r is None for r in rtts) / len(rtts))
        # Four traversals per ping (h0 up, h1 down, h1 up, h0 down), each dropping independently.
        expected = 1 - (1 - percent / 100) ** 4
        print(f"loss {percent}% per direction and host: ping loss {100 * statistics.median(measured):.2f}% "
              f"(expected {100 * expected:.2f}%, 2000 pings per run)", flush=True)


def bench_tcp(runs: int, seconds: float) -> None:
    for rtt in RTTS_MS:
        for buffers in ("stock", "raised"):
            rates = []
            for _ in range(runs):
                with netbed.Testbed(2, rate="100mbit", prefix=prefix("tcp"), delay=f"{rtt / 2}ms",
                                    tcp_buffers=buffers) as tb:
                    warmup = min(seconds / 5, 0.5 + 10 * rtt / 1e3)
                    rates.append(netprobe.measure_tcp(tb, 0, 1, seconds=seconds, warmup=warmup) / 1e6)
            bdp = 100e6 / 8 * rtt / 1e3 / 2**20
            print(f"tcp rtt {rtt} ms {buffers}: {statistics.median(rates):.1f} Mbit/s of 100 "
                  f"(BDP {bdp:.2f} MiB; runs {', '.join(f'{r:.1f}' for r in rates)})", flush=True)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def bench_cpu(runs: int, seconds: float) -> None:
    per_gb, core = [], []
    for _ in range(runs):
        with netbed.Testbed(2, rate="100mbit", prefix=prefix("cpu"), delay="25ms") as tb:
            lines = [tb._delay_lines[i].pid for i in range(2)]
            before = [cpu_seconds(p) for p in lines]
            moved = [sum(tb.link_stats(i)[d]["bytes_out"] for d in ("up", "down")) for i in range(2)]
            t0 = time.monotonic()
            threads = [threading.Thread(target=netprobe.measure_tcp, args=(tb, s, 1 - s),
                                        kwargs={"seconds": seconds, "port": 5201 + s}) for s in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - t0
            cpu = sum(cpu_seconds(p) - b for p, b in zip(lines, before))
            moved = sum(sum(tb.link_stats(i)[d]["bytes_out"] for d in ("up", "down")) - m
                        for i, m in zip(range(2), moved))
            # Each byte crosses two delay lines (the sender's up, the receiver's down): count it once per line.
            per_gb.append(cpu / (moved / 1e9))
            core.append(100 * cpu / 2 / wall)
    print(f"cpu at 100 Mbit/s both ways (RTT 50 ms): {statistics.median(per_gb):.2f} CPU s per GB through a delay "
          f"line, {statistics.median(core):.1f}% of one core per host's delay line", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each TCP run")
    p.add_argument("--only", default="rtt,jitter,loss,tcp,cpu")
    args = p.parse_args()
    netbed.require_root()
    benches = {"rtt": lambda: bench_rtt(args.runs), "jitter": lambda: bench_jitter(args.runs),
               "loss": lambda: bench_loss(args.runs), "tcp": lambda: bench_tcp(args.runs, args.seconds),
               "cpu": lambda: bench_cpu(args.runs, args.seconds)}
    for name in args.only.split(","):
        benches[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
