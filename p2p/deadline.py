"""How long a round's all-reduce may take: learned from the rounds that went before.

A fixed timeout is either too short for a slow link or far too long to notice
a stalled peer. Instead the deadline is a high quantile of the last rounds'
all-reduce times, times a safety margin, kept between a floor (so loopback
jitter cannot starve a round) and a ceiling (``swarm.round_timeout``). Until
there is history, the ceiling applies. The floor grows with the group's
round-trip time (``RTT_TRIPS`` of its farthest member's): rounds learned
among near peers must not starve one that takes a far peer in (a round
spends up to 10 round trips outside its exchange, docs/wan.md). Pure logic: time is passed in, nothing
here sleeps or reads the clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RTT_TRIPS = 40  # round trips a deadline allows at least: ~4x what a round costs outside its exchange


@dataclass(kw_only=True, slots=True)
class DeadlinePolicy:
    # Upper bound, also used before any round finished (swarm.round_timeout).
    ceiling: float
    # Lower bound, whatever the history says.
    floor: float = 5.0
    # Quantile of recent all-reduce durations the deadline is based on.
    quantile: float = 0.9
    # Multiplier on that quantile: room for a slower round than any seen.
    margin: float = 3.0
    # How many recent rounds to remember.
    window: int = 20
    _history: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        assert 0 < self.floor <= self.ceiling and 0 < self.quantile <= 1 and self.margin >= 1

    def observe(self, seconds: float) -> None:
        """Record the duration of a committed all-reduce (the payload is the same every round)."""
        self._history.append(max(seconds, 0.0))
        while len(self._history) > self.window:
            self._history.popleft()

    def deadline(self, rtt: float | None = None) -> float:
        """Seconds the next all-reduce may take before the attempt is abandoned; ``rtt``: the
        group's farthest member's round-trip time in seconds (None: not measured)."""
        if not self._history:
            return self.ceiling
        ranked = sorted(self._history)
        estimate = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))] * self.margin
        return min(self.ceiling, max(self.floor, RTT_TRIPS * (rtt or 0.0), estimate))
