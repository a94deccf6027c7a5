"""The aborts one member got in one attempt, kept to find who started them.

Every member that fails an attempt tells the others (p2p/votes.py), and every
member that hears of it passes it on, so an attempt ends at once everywhere.
Who is held to account (``Conduct.judge``) is the member that started it, with
the reason it gave and the member it named as the one it failed on.
"""

from __future__ import annotations


class Aborts:
    """Who sent an abort (in the order they came), its reason, and the member it named."""

    def __init__(self, members: list[str]) -> None:
        self._members = members
        self._reasons: dict[str, str] = {}  # member -> its reason
        self._named: dict[str, str | None] = {}  # member -> the culprit its abort named

    def add(self, member: str, reason: str, culprit: object = None) -> None:
        """``member``'s abort; ``culprit``: the index of the member it says it failed on, if it
        named one (only another member counts). The first abort of a member is the one kept."""
        self._reasons.setdefault(member, reason)
        named = (isinstance(culprit, int) and not isinstance(culprit, bool)
                 and 0 <= culprit < len(self._members) and self._members[culprit] != member)
        self._named.setdefault(member, self._members[culprit] if named else None)

    def reason(self, member: str | None) -> str:
        """The reason ``member``'s abort gave ("" if it sent none)."""
        return self._reasons.get(member, "")

    def named(self, member: str | None) -> str | None:
        """The other member ``member``'s abort named as the one it failed on, if any."""
        return self._named.get(member)

    def starter(self) -> str | None:
        """Who started the aborts: the first member that gave a reason of its own, not one
        passing another's abort on (every member does, so an attempt ends at once everywhere);
        failing that, the first whose abort came in. A leader that called the attempt off
        because a member refused it gives its own reason: a strike (an honest one leads again
        without the refuser; one whose groups keep being refused is no leader)."""
        first = next(iter(self._reasons), None)
        return next((m for m, r in self._reasons.items() if r != "aborted_by_peer"), first)
