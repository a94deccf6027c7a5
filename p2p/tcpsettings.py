"""Whether this host's TCP settings let one connection fill a long, fast link.

One TCP connection carries at most its window each round trip. Linux grows a
connection's buffers on its own, but only up to the third value of
``net.ipv4.tcp_wmem`` (sending) and ``net.ipv4.tcp_rmem`` (receiving); a
buffer also holds the kernel's bookkeeping, so about half of it is data in
flight (on the testbed at 200 ms RTT, a 4 MiB send limit carried ~70 Mbit/s
on a 100 Mbit/s link). Every round's pieces to one member travel over one
libp2p connection, so that limit is the member pair's speed: Linux's stock
4 MiB send limit caps a pair at ~67 Mbit/s at 250 ms, whatever the link.

A connection idle for longer than its retransmission timeout also restarts
from a window of 10 packets (``net.ipv4.tcp_slow_start_after_idle``), and a
node's connections idle through every inner loop: each round's exchange would
climb back through slow start, about log2(BDP / 14 KB) round trips (7 at
100 Mbit/s and 250 ms, 10 at 1 Gbit/s), sending little meanwhile.

Loss-based congestion control (cubic, Linux's default; reno) halves a
connection's window at every lost packet and regrows it one round trip at a
time: on the WAN testbed at 100 ms RTT and ~1% loss one cubic stream carried
1.6 Mbit/s of a 100 Mbit/s link, a bbr stream 94.8. bbr did not cost anything
where nothing was lost (4 peers' all-reduce at RTT 0 and 250 ms: within 6%
of cubic, docs/wan.md).

The node reads the settings of its own network namespace at start and says so
when they cap a connection below ``PLAN_RATE`` at ``PLAN_RTT`` (the links this
project is for: 1 Gbit/s hosts on other continents) or restart it after idling,
or lose throughput to loss, with the command that fixes them. The images set
the buffer and idle values (docker/compose.yml), and so does the WAN testbed
(scripts/wanlink.py); a container may choose bbr only where its host allows
it (``net.ipv4.tcp_allowed_congestion_control``), so that one is the host's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PLAN_RTT = 0.25  # seconds: hosts on different continents
PLAN_RATE = 1e9  # bits/s
# Share of a buffer limit that is data in flight (the rest is the kernel's per-packet bookkeeping).
USABLE = 0.5
# What the node advises (and the images set): 64 MiB covers 1 Gbit/s at 250 ms at USABLE.
ADVISED_MAX = 64 * 1024 * 1024
ADVISED = {"net.ipv4.tcp_wmem": f"4096 16384 {ADVISED_MAX}", "net.ipv4.tcp_rmem": f"4096 131072 {ADVISED_MAX}",
           "net.ipv4.tcp_slow_start_after_idle": "0"}


# Congestion controls that do not take a lost packet for a full link.
MODEL_BASED = frozenset({"bbr", "bbr2", "bbr3"})
CONGESTION_ADVICE = "modprobe tcp_bbr && sysctl -w net.ipv4.tcp_congestion_control=bbr"


def advice(keys) -> str:
    return "sysctl -w " + " ".join(f"{k}='{ADVISED[k]}'" if " " in ADVISED[k] else f"{k}={ADVISED[k]}"
                                   for k in keys)


@dataclass(frozen=True, slots=True)
class TcpSettings:
    """The TCP settings of this network namespace that decide a distant connection's speed."""

    send_max: int  # the most bytes Linux lets one connection buffer for sending
    receive_max: int  # ... and for receiving
    slow_start_after_idle: bool
    congestion: str = "bbr"  # the congestion control new connections use

    @classmethod
    def read(cls, proc: Path = Path("/proc/sys/net/ipv4")) -> "TcpSettings | None":
        """This network namespace's settings; None where they cannot be read (not Linux)."""
        try:
            send = (proc / "tcp_wmem").read_text().split()
            receive = (proc / "tcp_rmem").read_text().split()
            idle = (proc / "tcp_slow_start_after_idle").read_text().strip()
            congestion = (proc / "tcp_congestion_control").read_text().strip()
            return cls(int(send[2]), int(receive[2]), idle != "0", congestion)
        except (OSError, IndexError, ValueError):
            return None

    def cap(self, rtt: float) -> float:
        """The most bits/s one connection can carry at round-trip time ``rtt`` seconds."""
        return min(self.send_max, self.receive_max) * USABLE * 8 / rtt

    def warnings(self, rtt: float = PLAN_RTT, rate: float = PLAN_RATE) -> list[str]:
        """What to tell the operator: each setting that slows a connection over ``rate`` at ``rtt``."""
        out = []
        cap = self.cap(rtt)
        if cap < rate:
            out.append(f"TCP buffer limits cap one connection at {cap / 1e6:.0f} Mbit/s at {rtt * 1e3:.0f} ms RTT "
                       f"(net.ipv4.tcp_wmem max {self.send_max / 2**20:.1f} MiB, tcp_rmem max "
                       f"{self.receive_max / 2**20:.1f} MiB): rounds with distant peers will be slower than the "
                       f"link. To lift it (as root, on the host): "
                       f"{advice(['net.ipv4.tcp_wmem', 'net.ipv4.tcp_rmem'])}")
        if self.slow_start_after_idle:
            out.append("TCP restarts every connection from slow start after it idled "
                       "(net.ipv4.tcp_slow_start_after_idle=1): each round's exchange with distant peers first "
                       "spends several round trips sending little. To keep the window (as root, on the host): "
                       f"{advice(['net.ipv4.tcp_slow_start_after_idle'])}")
        if self.congestion not in MODEL_BASED:
            out.append(f"TCP congestion control is {self.congestion}, which slows a connection to a crawl on a "
                       "distant path that loses packets (on the testbed at 100 ms and 1% loss: 1.6 Mbit/s with "
                       f"cubic, 94.8 with bbr). To use bbr (as root, on the host): {CONGESTION_ADVICE}")
        return out
