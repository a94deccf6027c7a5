"""How the testbed shapes a link (scripts/netbed.py): rates, tbf buckets, congestion control.

Rates and sizes are written in tc's units (rates in SI bits: 100mbit; sizes in
bytes: 64kb), checked here before any namespace is made. Every shaper is a tbf
with a short queue and a small bucket, sized below; every host's TCP uses the
congestion control the testbed names (cubic unless told otherwise), not the
machine's default: see scripts/netbed.py for why.
"""

from __future__ import annotations

import re
from pathlib import Path

# Queue of each shaper, as tbf's latency: deep enough that TCP keeps the link
# full, short enough that a full queue adds only a home-router-like delay.
QUEUE_LATENCY = "50ms"
# tbf bucket: 16 KiB (about ten full-size frames), or 4 ms of traffic at high
# rates, where timer slack would otherwise leave the link idle between
# releases. The bucket is the only burst above nominal (<1% of a 2 s run).
# Measured TCP goodput is ~95.6% of nominal: tbf counts whole frames, and
# 1448 of every 1514 bytes are payload.
MIN_BURST = 16 * 1024
BURST_SECONDS = 0.004
# TCP congestion control of every host (see scripts/netbed.py); a non-root namespace may choose
# its default only from tcp_allowed_congestion_control, a route's congctl from any loaded one.
DEFAULT_CONGESTION = "cubic"

_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's units: SI, bits
_SIZE = re.compile(r"(\d+)(b|k|kb|m|mb)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}  # tc's units: bytes


def parse_rate(text: str) -> int:
    """'100mbit' -> 100_000_000 bits/s (tc's SI units bit, kbit, mbit, gbit); ValueError if malformed."""
    m = _RATE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"rate must look like 100mbit, 500kbit or 1gbit, got {text!r}")
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
    if not 8_000 <= bps <= 10 * 10**9:
        raise ValueError(f"rate must be between 8kbit and 10gbit, got {text!r}")
    return bps


def parse_size(text: str) -> int:
    """'64kb' -> 65536 bytes (tc's size units b, k/kb, m/mb); ValueError if malformed."""
    m = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None or int(m.group(1)) == 0:
        raise ValueError(f"burst must be a size in bytes like 65536, 64kb or 1mb, got {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()]


def burst_for(rate_bps: int) -> int:
    """The tbf bucket used for a rate (see MIN_BURST)."""
    return max(MIN_BURST, int(rate_bps / 8 * BURST_SECONDS))


def check_congestion(name: str) -> str:
    """``name`` if this kernel has that TCP congestion control loaded (what a route's ``congctl`` may
    name), else ValueError."""
    try:
        available = set(Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split())
    except OSError:
        available = {DEFAULT_CONGESTION}
    if name not in available:
        raise ValueError(f"congestion must be one of this kernel's {', '.join(sorted(available))}, got {name!r}")
    return name
