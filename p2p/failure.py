"""Why a round attempt cannot commit: the one exception every part of a round raises.

Its own module so that the pieces of a group (p2p/group.py and the classes it
owns) and the protocol around it raise and catch the same thing without
importing each other.
"""

from __future__ import annotations


class RoundFailed(Exception):
    """The group cannot commit; ``reason`` is a metric label, ``peer`` the member it failed on
    where the raiser knows it (one it could not dial)."""

    def __init__(self, reason: str, detail: str = "", peer: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.peer = peer
