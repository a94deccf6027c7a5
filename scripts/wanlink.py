"""The testbed's access links as a WAN sees them: delay, jitter, loss, asymmetric rates, and NAT.

A host's link (scripts/netbed.py) is one pair of interfaces: `eth0` on the
host's side, `port<i>` on the switch's bridge. With no delay, jitter or loss it
is a veth pair, as it always was. Otherwise it is a pair of TAP devices and a
delay line process (scripts/delayline.c) between them, which holds each frame
for its direction's delay. Either way tbf shapes both egresses: `eth0` is the
upload, `port<i>` the download, each at its own rate.

A host's `delay` is its share of the round-trip time, half on the way up and
half on the way down, so the RTT between hosts i and j is delay_i + delay_j.
`jitter` adds up to that much more to the host's share, uniformly drawn (half
per direction, never reordering frames); `loss` drops each frame with that
probability, independently in each direction.

A host behind NAT sits on a private subnet 10.78.<i>.0/24 (.2) behind a router
namespace `<prefix>-r<i>` (.1 there) that holds its WAN link and its public
address; the router masquerades what the host sends, forwards replies, and
forwards nothing that was not asked for. Like every testbed namespace it has
only its connected routes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Callable

import delayline

NAT_SUBNET = "10.78.{i}."  # host i's private /24 behind its router: router .1, host .2
MAX_DELAY = 10.0  # seconds of one host's share of the RTT
# Socket buffer limits of every host (net.ipv4.tcp_wmem / tcp_rmem: min, default, max). "raised" lets one TCP
# stream fill 1 Gbit/s at 500 ms RTT (a 62.5 MB bandwidth-delay product); "stock" is Linux's own defaults,
# set explicitly because a new namespace inherits the machine's values. net.core.wmem_max/rmem_max (the cap of
# an explicit SO_SNDBUF/SO_RCVBUF) are read-only outside the root namespace, which the testbed never touches.
# "raised" also keeps a connection's window through idle gaps (no slow start after idle): both are
# what a node advises at start and the images set (p2p/tcpsettings.py ADVISED; a test keeps them equal).
TCP_BUFFERS = {
    "raised": {"net.ipv4.tcp_wmem": "4096 16384 67108864", "net.ipv4.tcp_rmem": "4096 131072 67108864",
               "net.ipv4.tcp_slow_start_after_idle": "0"},
    "stock": {"net.ipv4.tcp_wmem": "4096 16384 4194304", "net.ipv4.tcp_rmem": "4096 131072 6291456",
              "net.ipv4.tcp_slow_start_after_idle": "1"},
}
NAT_RULES = """table ip gonka_nat {{
  chain postrouting {{ type nat hook postrouting priority srcnat; oifname "{wan}" masquerade; }}
  chain forward {{ type filter hook forward priority filter; policy drop;
    ct state established,related accept; iifname "{lan}" oifname "{wan}" accept; }}
}}"""

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)", re.IGNORECASE)
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

Cmd = Callable[..., str]  # netns.cmd: run argv, return stdout, TestbedError on failure


def parse_duration(value: str | float, what: str = "delay") -> float:
    """'50ms' -> 0.05 seconds (units us, ms, s; a bare number is seconds); ValueError if malformed."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value.strip() == "0":
        seconds = 0.0
    else:
        m = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
        if m is None:
            raise ValueError(f"{what} must look like 50ms, 250us or 0.1s, got {value!r}")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    if not 0 <= seconds <= MAX_DELAY:
        raise ValueError(f"{what} must be between 0 and {MAX_DELAY:g}s, got {value!r}")
    return seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One host's access link."""

    up_rate: int  # bits/s the host can send (tbf on its eth0)
    down_rate: int  # bits/s the host can receive (tbf on the switch's port)
    delay: float = 0.0  # seconds: the host's share of the RTT, half each way
    jitter: float = 0.0  # seconds: up to this much more on the host's share, half each way
    loss: float = 0.0  # probability that a frame is dropped, each direction on its own

    def __post_init__(self) -> None:
        if not (0 <= self.delay <= MAX_DELAY and 0 <= self.jitter <= MAX_DELAY):
            raise ValueError(f"delay and jitter must be 0-{MAX_DELAY:g}s, got {self.delay!r}, {self.jitter!r}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be a fraction in [0, 1), got {self.loss!r}")

    @property
    def needs_delay_line(self) -> bool:
        return bool(self.delay or self.jitter or self.loss)

    def each_way(self) -> delayline.Direction:
        """What the delay line does in each direction: half the delay and jitter, all of the loss."""
        return delayline.Direction(delay=self.delay / 2, jitter=self.jitter / 2, loss=self.loss)

    def queue_bytes(self) -> int:
        """The delay line's bound per direction: four times what the faster direction has in flight, >= 4 MiB.
        Frames reach it already shaped, so only a stalled delay line fills it."""
        in_flight = max(self.up_rate, self.down_rate) / 8 * (self.delay + self.jitter) / 2
        return min(1 << 32, max(4 << 20, int(4 * in_flight)))


def add_link(cmd: Cmd, link: Link, host: str, switch: str, port: str, upload: list[str], download: list[str],
             files: Path, seed: int) -> Popen | None:
    """Connect `eth0` in namespace ``host`` to `port` on the switch's br0, shaped both ways.

    ``upload``/``download``: the tbf arguments of each egress. Returns the delay line's process, or None
    for a plain veth link. The caller configures addresses and brings `eth0` up."""
    proc = None
    if link.needs_delay_line:
        proc = delayline.start((host, "eth0"), (switch, port), up=link.each_way(),
                               down=link.each_way(), queue_bytes=link.queue_bytes(),
                               stats_path=files / f"{port}.json", log_path=files / f"{port}.log", seed=seed)
    else:  # created directly inside the two namespaces: the root namespace never sees the veth
        cmd("ip", "link", "add", "eth0", "netns", host, "type", "veth", "peer", "name", port, "netns", switch)
    cmd("ip", "-n", switch, "link", "set", port, "master", "br0")
    # One segment per packet: with segmentation offload TCP hands tbf 64 KiB packets; then a downloading
    # host's shaper dropped whole bursts, TCP stalled on retransmission timeouts and a 10mbit download
    # measured 4.4 Mbit/s in half the runs.
    for ns, dev in ((host, "eth0"), (switch, port)):
        cmd("ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", "1")
    cmd("tc", "-n", host, "qdisc", "replace", "dev", "eth0", *upload)
    cmd("tc", "-n", switch, "qdisc", "replace", "dev", port, *download)
    cmd("ip", "-n", switch, "link", "set", port, "up")
    return proc


def add_router(cmd: Cmd, router: str, host: str, i: int) -> None:
    """Put host ``i`` behind NAT: a veth from its `eth0` to the router's `lan0`, masquerading out of the
    router's `eth0` (its WAN link, made by add_link). The host's default route is the router."""
    lan = NAT_SUBNET.format(i=i)
    cmd("ip", "link", "add", "eth0", "netns", host, "type", "veth", "peer", "name", "lan0", "netns", router)
    for ns, dev, ip in ((host, "eth0", f"{lan}2"), (router, "lan0", f"{lan}1")):
        cmd("ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", "1")
        cmd("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        cmd("ip", "-n", ns, "link", "set", dev, "up")
    cmd("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    cmd("ip", "netns", "exec", router, "nft", NAT_RULES.format(wan="eth0", lan="lan0"))


def set_tcp_buffers(cmd: Cmd, ns: str, buffers: str) -> None:
    cmd("ip", "netns", "exec", ns, "sysctl", "-qw", *(f"{key}={value}" for key, value in TCP_BUFFERS[buffers].items()))
