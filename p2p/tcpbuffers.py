"""Whether this host's TCP buffer limits let one connection fill a long, fast link.

One TCP connection carries at most its window each round trip. Linux grows a
connection's buffers on its own, but only up to the third value of
``net.ipv4.tcp_wmem`` (sending) and ``net.ipv4.tcp_rmem`` (receiving); a
buffer also holds the kernel's bookkeeping, so about half of it is data in
flight (on the testbed at 200 ms RTT, a 4 MiB send limit carried ~70 Mbit/s
on a 100 Mbit/s link). Every round's pieces to one member travel over one
libp2p connection, so that limit is the member pair's speed: Linux's stock
4 MiB send limit caps a pair at ~67 Mbit/s at 250 ms, whatever the link.

The node reads the limits of its own network namespace at start and says so
when they cap a connection below ``PLAN_RATE`` at ``PLAN_RTT`` (the links this
project is for: 1 Gbit/s hosts on other continents), with the command that
lifts them. The images set the lifted values (docker/compose.yml).
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
ADVICE = (f"sysctl -w net.ipv4.tcp_wmem='4096 16384 {ADVISED_MAX}' "
          f"net.ipv4.tcp_rmem='4096 131072 {ADVISED_MAX}'")


@dataclass(frozen=True, slots=True)
class TcpBuffers:
    """The most bytes Linux lets one TCP connection buffer for sending and for receiving."""

    send_max: int
    receive_max: int

    @classmethod
    def read(cls, proc: Path = Path("/proc/sys/net/ipv4")) -> "TcpBuffers | None":
        """This network namespace's limits; None where they cannot be read (not Linux)."""
        try:
            send = (proc / "tcp_wmem").read_text().split()
            receive = (proc / "tcp_rmem").read_text().split()
            return cls(int(send[2]), int(receive[2]))
        except (OSError, IndexError, ValueError):
            return None

    def cap(self, rtt: float) -> float:
        """The most bits/s one connection can carry at round-trip time ``rtt`` seconds."""
        return min(self.send_max, self.receive_max) * USABLE * 8 / rtt

    def warning(self, rtt: float = PLAN_RTT, rate: float = PLAN_RATE) -> str | None:
        """What to tell the operator when these limits cap a connection below ``rate`` at ``rtt``."""
        cap = self.cap(rtt)
        if cap >= rate:
            return None
        return (f"TCP buffer limits cap one connection at {cap / 1e6:.0f} Mbit/s at {rtt * 1e3:.0f} ms RTT "
                f"(net.ipv4.tcp_wmem max {self.send_max / 2**20:.1f} MiB, tcp_rmem max "
                f"{self.receive_max / 2**20:.1f} MiB): rounds with distant peers will be slower than the link. "
                f"To lift it (as root, on the host): {ADVICE}")
