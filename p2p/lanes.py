"""How many streams ("lanes") a group's members open to each other for one part.

The leader picks the count (``lanes_for_rtt``) and names it in its ``begin``
(p2p/formation.py); ``Group`` cuts every part's pieces over that many lanes.
"""

from __future__ import annotations

import math

# Streams ("lanes") a member opens to each other member for one part: lane l carries the
# pieces k with k % lanes == l, both ways. Measured on the 4-host 100 Mbit/s testbed, fp32,
# 7 syncs each: 1 lane 13.5-16.0 s (median 14.8), 2 lanes median 14.1, 4 lanes 13.1-13.8 s
# (median 13.5); int4 and fp4 unchanged. With one stream per peer pair, a host whose
# download was full saw its uploads stall for seconds with nothing queued in TCP (Send-Q 0):
# the stream's flow-control updates came back through that full download queue.
LANES = 4
# Far apart, more: every round's part streams are new, and a new libp2p (yamux) stream may have
# only 256 KiB in flight per round trip until its window grows. On the WAN testbed at 250 ms one
# new stream moved 16 MiB at 32-43 Mbit/s, 16 streams at 79 (one TCP stream: 95.6). A group's
# lanes keep 4 lanes' first window per 50 ms of round-trip time (``lanes_for_rtt``), up to
# MAX_LANES: at any RTT the first round trip carries what 4 lanes carry on a 50 ms path.
MAX_LANES = 16
LANE_RTT = 0.05


def lanes_for_rtt(rtt: float | None) -> int:
    """Lanes per member and part for a group whose farthest member is ``rtt`` seconds away."""
    if rtt is None or rtt <= LANE_RTT:
        return LANES
    return min(MAX_LANES, LANES * math.ceil(rtt / LANE_RTT - 1e-9))
