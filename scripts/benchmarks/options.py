"""Command-line value types shared by the benchmarks' options."""

from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer no smaller than ``low`` (argparse names the option on error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "integer"  # what argparse calls a value it cannot convert
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def add_wan_arguments(group) -> None:
    """--rtt, --jitter, --loss and --tcp-buffers: the WAN testbed's settings (docs/testbed.md)."""
    group.add_argument("--rtt", type=non_negative_float, default=0.0,
                       help="round-trip time between any two hosts, ms (default 0: the LAN testbed)")
    group.add_argument("--jitter", type=non_negative_float, default=0.0,
                       help="extra random delay on that round trip, up to this many ms (default 0)")
    group.add_argument("--loss", type=non_negative_float, default=0.0,
                       help="percent of packets lost between two hosts, each way (default 0)")
    group.add_argument("--tcp-buffers", choices=("raised", "stock"), default="raised",
                       help="the hosts' TCP buffer limits: raised to cover 1 Gbit/s at 250 ms (default, as the "
                            "images set them) or Linux's stock ones")


def wan_settings(args) -> dict:
    """The Testbed arguments of --rtt, --jitter, --loss and --tcp-buffers. A path crosses two hosts'
    links, so each link direction gets half the delay and jitter and loses 1 - sqrt(1 - loss)."""
    loss = getattr(args, "loss", 0.0) / 100
    if loss >= 1:
        raise ValueError(f"--loss must be below 100 percent, got {args.loss}")
    return {"delay": getattr(args, "rtt", 0.0) / 2000, "jitter": getattr(args, "jitter", 0.0) / 2000,
            "loss": 1 - (1 - loss) ** 0.5, "tcp_buffers": getattr(args, "tcp_buffers", "raised")}
